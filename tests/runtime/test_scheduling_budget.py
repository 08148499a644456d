"""The branch budget (pure): full grants when they fit, fair cuts when not, pins wait, none starves."""

from __future__ import annotations

from pathlib import Path

import pytest

from lopa.decoding.generation import RoundPlan
from lopa.scheduling.budget import Budget, Claim, default_budget, executor_tokens, grant


def ask(k: int, width: int = 10, pinned: bool = False, waited: int = 0, sequence: int = 0) -> Claim:
    return Claim(RoundPlan(k, (width,) * (k + 1)), k, pinned, waited, sequence)


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
    # cuda's: the fixed count until (or when not) measured (lopa.scheduling.calibration)
    cpu, cuda = default_budget("cpu"), default_budget("cuda:3")
    assert default_budget("npu") == cuda == Budget(512)
    assert cuda.limit([ask(3, width=128)] * 8, executors=4) == cuda.tokens  # a fixed count per worker
    assert cuda.describe() == "512 tokens per forward per worker"
    # CPU: the load of every running request running its base row and one lookahead row.
    asks = [ask(3, width=10), ask(3, width=24), ask(0, width=7)]
    assert cpu.limit(asks) == 20 + 48 + 7 and grant(asks, cpu.limit(asks)) == [1, 1, 0]
    assert cpu.describe() == ("each running request's base row and up to 1 lookahead row per forward, "
                              "on the busiest worker (pinned: all rows)")
    with pytest.raises(ValueError, match="tokens > 0 or rows_per_request > 0"):
        Budget()
    stated = "cpu a base row and one lookahead row per running request"
    repo = Path(__file__).resolve().parents[2]
    docs = ("docs/concepts/branch-budget.md", "docs/lopa.yaml", "runtime/lopa/cli/serve.py",
            "runtime/lopa_bench/cli/concurrency.py", "manifests/crds/lopadeployments.lopa.dev.yaml",
            "manifests/install.yaml",
            "charts/lopa-operator/crds/lopadeployments.lopa.dev.yaml")
    for doc in docs:
        words = " ".join((repo / doc).read_text().replace("#", " ").replace('"', " ").split())
        # wrapped lines and comment marks joined; the CRDs say GPU where the CLI says cuda
        accelerators = ("cuda/npu measured at start", "GPU/NPU measured at start")
        assert stated in words and any(phrase in words for phrase in accelerators), doc


def test_the_cpu_default_shares_rounds_whatever_the_row_width() -> None:
    """Rows of any width (block size 32: ~96 tokens) share the round, one lookahead each, where a
    fixed token count would make them wait and take turns."""
    cpu = default_budget("cpu")
    for running in (2, 3, 4):
        asks = [ask(3, width=96, sequence=s) for s in range(running)]
        assert grant(asks, cpu.limit(asks)) == [1] * running
        for executors in (2, 3):
            # The share as placed on the workers: the busiest one's load. A worker that carries less
            # may take more lookaheads at no cost to the round's time, never fewer than the share.
            limit = cpu.limit(asks, executors)
            grants = grant(asks, limit, executors)
            assert None not in grants and min(grants) >= 1
            assert executor_tokens(asks, grants, executors) <= limit


def test_the_cpu_default_makes_room_for_a_pinned_request() -> None:
    """A pinned k = 5 beside a k = 3 request: both run every round (the pinned one with all its
    rows), rather than one of them waiting."""
    cpu = default_budget("cpu")
    asks = [ask(3, width=24), ask(5, width=24, pinned=True, sequence=1)]
    for executors in (1, 2):
        assert grant(asks, cpu.limit(asks, executors), executors) == [1, 5]


def test_a_finished_lookahead_takes_no_place_on_the_executors() -> None:
    """A finished candidate is not verified: the rows after it move up in the rotation (what the
    distributed executor places), so the base row lands where the finished one would have."""
    finished_first = Claim(RoundPlan(1, (0, 96)), 3, sequence=7)  # its live row (the base) on rank 7 % 3
    other = Claim(RoundPlan(1, (96, 96)), 3, sequence=6)  # lookahead on rank 0, base on rank 1
    assert executor_tokens([finished_first, other], [1, 1], executors=3) == 192  # both on rank 1


def test_identical_requests_share_the_slack_over_rounds() -> None:
    """When the budget leaves room for only some of the lookaheads, who gets them rotates: after
    many rounds every request has had about as many as the others."""
    for budget, executors, count in ((Budget(512), 1, 3), (Budget(512), 2, 6), (default_budget("cpu"), 3, 4)):
        received = [0] * count
        for rounds in range(1, 61):
            asks = [
                Claim(RoundPlan(3, (128,) * 4), 3, sequence=s, received=received[s] / max(1, rounds - 1))
                for s in range(count)
            ]
            grants = grant(asks, budget.limit(asks, executors), executors)
            assert None not in grants
            received = [r + (g or 0) for r, g in zip(received, grants, strict=True)]
        assert max(received) - min(received) <= 1, (budget, executors, received)
