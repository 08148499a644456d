"""The local engine batches concurrent requests, and a request's output never depends on its batch.

16 concurrent mixed requests (prompts, lengths, k, stop strings, both attention modes, two sampled
with a seed) give, token for token, what each gives alone on the same engine; the rounds really were
batched. Under a tight budget the branches granted drop (visible per round and in the result),
pinned requests keep theirs, and every request still finishes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from lopa.bundled import tasks
from lopa.decoding.generation import StepEvent
from lopa.engine import LocalEngine, bundled_model_dir
from lopa.model.decoding_defaults import model_defaults
from lopa.scheduling.request import Completion
from lopa.scheduling.scheduler import Observer
from tests.helpers.mixed import MixedRequest, mixed_requests


class Rounds(Observer):
    def __init__(self) -> None:
        self.batches: list[int] = []
        self.granted: list[list[int]] = []
        self.lock = threading.Lock()

    def round(self, batch: int, granted: Sequence[int], wanted: Sequence[int]) -> None:
        with self.lock:
            self.batches.append(batch)
            self.granted.append(list(granted))


def run_all(engine: LocalEngine, requests: list[MixedRequest], concurrent: bool) -> list[Completion]:
    call: Callable[[MixedRequest], Completion] = lambda r: engine.generate(r.prompt, r.params, stop=r.stop)  # noqa: E731
    if not concurrent:
        return [call(r) for r in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(call, requests))


def same(a: Completion, b: Completion) -> bool:
    ra, rb = a.result, b.result
    fields = ("output_ids", "generated_ids", "winners", "granted_branches", "verified_tokens")
    return (a.text, a.finish_reason, *(getattr(ra, f) for f in fields)) == (
        b.text, b.finish_reason, *(getattr(rb, f) for f in fields))


@pytest.fixture(scope="module")
def rounds() -> Rounds:
    return Rounds()


@pytest.fixture(scope="module")
def engine(rounds: Rounds) -> LocalEngine:
    loaded = LocalEngine.from_dirs(bundled_model_dir()).loaded
    return LocalEngine(loaded, max_batch=16, max_step_tokens=100_000, observer=rounds)


def test_sixteen_concurrent_requests_equal_each_alone(engine: LocalEngine, rounds: Rounds) -> None:
    requests = mixed_requests()
    alone = run_all(engine, requests, concurrent=False)
    assert max(rounds.batches) == 1
    rounds.batches.clear()
    together = run_all(engine, requests, concurrent=True)
    assert max(rounds.batches) >= 8, rounds.batches  # they really shared forwards
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        assert same(a, b), f"request {i} changed in a batch"
    assert {c.finish_reason for c in alone} >= {"stop", "eos"}
    for i, c in enumerate(alone):  # alone, every round got the lookaheads it could spawn, up to k
        assert max(c.result.granted_branches) == (0, 1, 3, 5)[i % 4] or c.result.forwards <= 2


def test_a_tight_budget_trades_branches_for_batch_size_and_pins_hold() -> None:
    loaded = LocalEngine.from_dirs(bundled_model_dir()).loaded
    rounds = Rounds()
    engine = LocalEngine(loaded, max_batch=8, max_step_tokens=200, observer=rounds)
    defaults = model_defaults(bundled_model_dir()).with_overrides(branches=3)
    prompts = [e.prompt for e in tasks.held_out(8)]
    pinned_events: list[StepEvent] = []

    def one(i: int) -> Completion:
        pin = i == 0
        on_step = pinned_events.append if pin else None
        return engine.generate(prompts[i], defaults, pin_branches=pin, on_step=on_step)

    with ThreadPoolExecutor(8) as pool:
        done = list(pool.map(one, range(8)))
    assert all(c.result.output_ids for c in done)
    cut = [g for granted in rounds.granted for g in granted if g < 3]
    assert cut, "a 200-token budget must cut some lookaheads of 8 requests with k=3"
    assert min(done[i].result.mean_branches for i in range(1, 8)) < 3
    # the pinned request was never cut: its output is the one it gives alone
    alone = engine.generate(prompts[0], defaults)
    assert same(alone, done[0]) and len(pinned_events) == done[0].result.forwards
