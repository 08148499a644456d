"""Which worker verifies which candidate: round robin, so k + 1 > W shares workers evenly."""

from __future__ import annotations


def rank_of(candidate: int, workers: int) -> tuple[int, int]:
    """(rank, staging slot on that rank) of a candidate."""
    return candidate % workers, candidate // workers


def shares(candidates: int, workers: int) -> list[list[int]]:
    """Per rank, the candidate indices it verifies, in slot order."""
    out: list[list[int]] = [[] for _ in range(workers)]
    for candidate in range(candidates):
        out[candidate % workers].append(candidate)
    return out
