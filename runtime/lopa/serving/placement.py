"""Which worker verifies which candidate: round robin, so k + 1 > W shares workers evenly.

A request's candidates start at rank (offset % W), offset being its KV slot: requests with few
branches (D2F, or cut by the budget) then spread over the workers instead of all landing on rank 0.
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
