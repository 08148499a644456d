"""Which rank verifies which candidate: round robin, so k + 1 > W shares the ranks evenly.

A request's candidates start at rank (offset % W), offset being its KV sequence: requests with few
branches (D2F, or cut by the budget) then spread over the ranks instead of all landing on rank 0.
The master places (shares, rank_of); each rank recovers its candidates from its slots (candidates_on).
"""

from __future__ import annotations


def rank_of(candidate: int, workers: int, offset: int = 0) -> tuple[int, int]:
    """(rank, staging slot on that rank) of a candidate."""
    return (candidate + offset) % workers, candidate // workers


def shares(candidates: int, workers: int, offset: int = 0) -> list[list[int]]:
    """Per rank, the candidate indices it verifies, in slot order."""
    out: list[list[int]] = [[] for _ in range(workers)]
    for candidate in range(candidates):
        out[(candidate + offset) % workers].append(candidate)
    return out


def candidates_on(rank: int, slots: int, workers: int, offset: int = 0) -> list[int]:
    """The candidate in each of a rank's staging slots 0..slots-1 (the inverse of rank_of)."""
    first = (rank - offset) % workers
    return [slot * workers + first for slot in range(slots)]
