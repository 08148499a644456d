"""How requests end around a stopping scheduler, and what its round reports count (lopa.scheduling).

A real Scheduler over the real LocalExecutor and Decoder on a SyntheticModel (the rules of
synthetic_cases): no request may be accepted that nothing will serve, and every accepted one is
settled, whatever the timing of stop().
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest
from synthetic_cases import EOS, MASK, MAX_LENGTH, VOCAB, hash_choice, rule_from

from lopa.decoding.decoder import Decoder
from lopa.execution.local import LocalExecutor
from lopa.params import DecodingParams
from lopa.scheduling.budget import Budget
from lopa.scheduling.request import Completion, QueueFull, Request, SchedulerStopped, Waiter
from lopa.scheduling.scheduler import Observer, Scheduler
from tests.helpers.rule_model import SyntheticModel

PROMPT = [1, 2, 3, 4]
PARAMS = DecodingParams(block_size=4, max_new_tokens=16, branches=2)
SETTLE_S = 10.0  # generous: a settled request takes milliseconds
UNLIMITED = Budget(tokens=100_000)


class Cuts(Observer):
    """Per round: what each request could have been granted and what it got."""

    def __init__(self) -> None:
        self.rounds: list[tuple[list[int], list[int]]] = []

    def round(self, batch: int, granted: Sequence[int], wanted: Sequence[int]) -> None:
        self.rounds.append((list(wanted), list(granted)))

    @property
    def cut(self) -> int:
        return sum(w - g for wanted, granted in self.rounds for w, g in zip(wanted, granted, strict=True))


def scheduler(budget: Budget = UNLIMITED, observer: Observer | None = None, queue_size: int = 64
              ) -> Scheduler:
    model = SyntheticModel(VOCAB, MAX_LENGTH, rule_from(hash_choice(len(PROMPT))), max_batch=4)
    executor = LocalExecutor(model)
    decoder = Decoder(executor, MASK, (EOS,), MAX_LENGTH)
    text = lambda ids: "".join(chr(ord("a") + t) for t in ids if t not in (MASK, EOS))  # noqa: E731
    return Scheduler(decoder, executor, text, queue_size, budget, observer)


def submit(s: Scheduler, params: DecodingParams = PARAMS) -> Waiter:
    waiter = Waiter()
    s.submit(Request(list(PROMPT), params, on_done=waiter))
    return waiter


def test_a_stopped_scheduler_refuses_requests_instead_of_keeping_them() -> None:
    s = scheduler()
    s.start()
    first = submit(s)
    assert isinstance(first.outcome(SETTLE_S), Completion)
    s.stop()
    # Refused at once: queued, it would never settle and its caller would wait forever.
    with pytest.raises(SchedulerStopped, match="stopping"):
        submit(s)


def test_requests_racing_a_stop_are_refused_or_settled() -> None:
    s = scheduler(queue_size=64)
    s.start()
    accepted: list[Waiter] = []
    refused = 0
    lock = threading.Lock()
    sending = threading.Event()

    def client(_: int) -> None:
        """Send until refused: every client is still sending when the stop lands."""
        nonlocal refused
        while True:
            try:
                settled = submit(s)
            except QueueFull:  # the queue is busy: send again
                time.sleep(0.001)
                continue
            except SchedulerStopped:
                with lock:
                    refused += 1
                return
            with lock:
                accepted.append(settled)
            sending.set()

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client, i) for i in range(4)]
        assert sending.wait(SETTLE_S)
        s.stop()
        for future in futures:
            future.result(SETTLE_S)
    assert refused == 4 and accepted  # each client's last request was refused, not lost
    for settled in accepted:
        outcome = settled.outcome(SETTLE_S)
        assert outcome is not None, "an accepted request was never settled"
        assert isinstance(outcome, (Completion, SchedulerStopped))


def test_lookaheads_a_round_cannot_spawn_are_not_counted_as_cut() -> None:
    cuts = Cuts()
    s = scheduler(observer=cuts)
    s.start()
    alone = submit(s, DecodingParams(block_size=4, max_new_tokens=16, branches=5))
    assert isinstance(alone.outcome(SETTLE_S), Completion)
    s.stop()
    assert any(granted[0] < 5 for _, granted in cuts.rounds)  # rounds that spawned fewer than asked
    assert cuts.cut == 0  # a lone request under a budget it never reaches loses nothing


def test_lookaheads_the_budget_takes_are_counted_as_cut() -> None:
    cuts = Cuts()
    s = scheduler(Budget(tokens=8), cuts)  # one base row of a 4-token block at most
    s.start()
    requests = [submit(s) for _ in range(3)]
    for settled in requests:
        assert isinstance(settled.outcome(SETTLE_S), Completion)
    s.stop()
    assert cuts.cut > 0


def test_a_request_whose_own_round_fails_ends_alone() -> None:
    """A failure in one request's decoding logic (here injected into its Generation.apply on its
    second round) ends that request with the error; the request beside it decodes as alone (before:
    every running request failed with 'internal scheduler error')."""
    other = [5, 6, 7, 8]
    alone = scheduler()
    alone.start()
    reference = Waiter()
    alone.submit(Request(list(other), PARAMS, on_done=reference))
    assert isinstance(reference.outcome(SETTLE_S), Completion)
    alone.stop()

    s = scheduler()
    started = []
    start = s.decoder.start

    def recording_start(*args: object, **kwargs: object) -> object:
        started.append(start(*args, **kwargs))
        return started[-1]

    s.decoder.start = recording_start  # type: ignore[method-assign]
    failing, healthy = Waiter(), Waiter()
    s.submit(Request(list(PROMPT), PARAMS, on_done=failing))
    s.submit(Request(list(other), PARAMS, on_done=healthy))
    apply, calls = started[0].apply, []

    def broken_apply(*args: object) -> object:
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("injected: this request's round failed")
        return apply(*args)

    started[0].apply = broken_apply  # type: ignore[method-assign]
    s.start()
    failed, served, alone_done = failing.outcome(SETTLE_S), healthy.outcome(SETTLE_S), reference.outcome()
    s.stop()
    assert isinstance(failed, ValueError) and "injected" in str(failed)
    assert isinstance(served, Completion) and isinstance(alone_done, Completion)
    assert served.result.output_ids == alone_done.result.output_ids
    assert served.result.winners == alone_done.result.winners


def test_requests_sent_together_are_queued_all_or_none() -> None:
    """An HTTP batch: 3 of 4 places taken (not started: nothing admits them), 2 more refused together,
    none of them queued; then 1 fits; once started, all 4 are served."""
    s = scheduler(queue_size=4)
    waiters = [submit(s) for _ in range(3)]
    pair = [Request(list(PROMPT), PARAMS, on_done=Waiter()) for _ in range(2)]
    with pytest.raises(QueueFull, match="1 of 4 places free, 2 requests were sent together"):
        s.submit_many(pair)
    assert s.waiting == 3
    waiters.append(submit(s))
    s.start()
    try:
        assert all(isinstance(w.outcome(SETTLE_S), Completion) for w in waiters)
    finally:
        s.stop()


def test_a_deadline_names_whose_it_is() -> None:
    """The server's limit or the client's own deadline: the 504 / DEADLINE_EXCEEDED says which."""
    import time

    from lopa.scheduling.request import Abort, RequestAborted

    expected = r"deadline exceeded: limits.request_timeout_s \(300 s\)"
    with pytest.raises(RequestAborted, match=expected) as info:
        Abort(deadline=time.monotonic() - 1, deadline_of="limits.request_timeout_s (300 s)").check()
    assert info.value.deadline
