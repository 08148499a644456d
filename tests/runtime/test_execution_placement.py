"""Which rank verifies which candidate (lopa.execution.placement), and its inverse on each rank."""

from __future__ import annotations

import pytest

from lopa.execution.placement import candidates_on, rank_of, shares


def test_round_robin_placement() -> None:
    assert shares(6, 2) == [[0, 2, 4], [1, 3, 5]]
    assert shares(2, 3) == [[0], [1], []]
    assert [rank_of(c, 3) for c in range(5)] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1)]


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_each_rank_recovers_its_candidates_from_its_slots(workers: int) -> None:
    for candidates in range(1, 10):
        for offset in range(6):
            for rank, mine in enumerate(shares(candidates, workers, offset)):
                assert candidates_on(rank, len(mine), workers, offset) == mine
                assert all(rank_of(c, workers, offset) == (rank, slot) for slot, c in enumerate(mine))
