"""The branch budget (pure): full grants when they fit, fair cuts when not, pins wait, none starves."""

from __future__ import annotations

from pathlib import Path

from lopa.decoding.generation import RoundPlan
from lopa.scheduling.budget import Ask, Budget, default_budget, executor_tokens, grant


def ask(k: int, width: int = 10, pinned: bool = False, waited: int = 0, sequence: int = 0) -> Ask:
    return Ask(RoundPlan(k, (width,) * (k + 1)), k, pinned, waited, sequence)


def test_everything_fits_everyone_gets_what_it_asked() -> None:
    asks = [ask(3), ask(0), ask(5)]
    assert grant(asks, budget=120) == [3, 0, 5]  # 4 + 1 + 6 rows of 10 tokens = 110


def test_cuts_take_from_the_richest_first_down_to_zero() -> None:
    asks = [ask(3), ask(3), ask(1)]  # 4 + 4 + 2 rows = 100 tokens
    assert grant(asks, budget=80) == [2, 2, 1]  # two cuts: the 3s, lower priority first
    assert grant(asks, budget=70) == [2, 1, 1]
    assert grant(asks, budget=30) == [0, 0, 0]


def test_a_lone_request_is_never_cut() -> None:
    assert grant([ask(7, width=64)], budget=16) == [7]


def test_pinned_requests_wait_instead_of_being_cut_and_priority_rises_with_waiting() -> None:
    asks = [ask(3), ask(3, pinned=True)]
    assert grant(asks, budget=50) == [0, 3]  # 1 + 4 rows: the unpinned one is cut to 0
    asks = [ask(3), ask(3, pinned=True), ask(0)]
    assert grant(asks, budget=40) == [2, None, 0]  # the pinned one does not fit: it waits
    asks = [ask(3), ask(3, pinned=True, waited=1), ask(0)]
    assert grant(asks, budget=40) == [None, 3, None]  # having waited, it goes first


def test_no_request_starves() -> None:
    """Requests that never fit together take turns: each waits at most len(asks) - 1 rounds."""
    waited = [0, 0, 0]
    ran = [0, 0, 0]
    for _ in range(30):
        asks = [ask(2, width=30, pinned=True, waited=w) for w in waited]
        grants = grant(asks, budget=100)  # one pinned 3-row request per round
        for i, g in enumerate(grants):
            waited[i] = 0 if g is not None else waited[i] + 1
            ran[i] += g is not None
        assert max(waited) <= 2
    assert ran == [10, 10, 10]


def test_the_budget_is_per_executor_with_rows_spread_from_each_slot() -> None:
    asks = [ask(1, sequence=0), ask(1, sequence=1)]
    # 2 executors: request 0's rows on ranks 0, 1; request 1's on ranks 1, 0: 20 tokens each
    assert executor_tokens(asks, [1, 1], executors=2) == 20
    assert executor_tokens(asks, [1, 1], executors=1) == 40
    assert grant(asks, budget=20, executors=2) == [1, 1]
    assert grant(asks, budget=20, executors=1) == [0, 0]


def test_defaults_per_device_kind_are_the_documented_ones() -> None:
    cpu, cuda = default_budget("cpu"), default_budget("cuda:3")
    assert default_budget("npu") == cuda and cuda == Budget(cuda.tokens) and cuda.limit(64) == cuda.tokens
    # A CPU default is a share per running request (split over the workers); an accelerator's is a
    # fixed count per worker.
    assert [cpu.limit(n) for n in (1, 2, 8, 16)] == [cpu.per_request * n for n in (1, 2, 8, 16)]
    for workers in (2, 4):
        split = default_budget("cpu", executors=workers)
        assert split.limit(3) == 3 * (cpu.per_request // workers)
    assert default_budget("cuda", executors=4) == cuda and default_budget("npu:1", executors=2) == cuda
    assert cpu.describe() == f"{cpu.per_request} tokens per running request, per forward per worker"
    stated = f"cpu {cpu.per_request} x running requests split over the workers, cuda/npu {cuda.tokens}"
    repo = Path(__file__).resolve().parents[2]
    for doc in ("README.md", "docs/lopa.yaml", "runtime/lopa/cli/serve.py"):
        words = (repo / doc).read_text().replace("#", " ").split()  # wrapped comment lines joined
        assert stated in " ".join(words), doc
