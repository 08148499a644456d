"""Dispatch: admitted requests into the shared Scheduler, transport-free events back out.

An API adapter calls `Dispatcher.open` with its requests as `Ask`s: they are admitted (off the
event loop: tokenizing a prompt takes time), queued all or none, and come back as `Ticket`s. The
scheduler thread (lopa.scheduling.scheduler) batches every running request's rounds over the
master's executor and posts each ticket's events to the event loop: a Progress per round for a
stream, then a Finished, or the error that ended it. Every request is counted once in
`lopa_requests_total`: refused at the door, or settled when its client reads the end, or cancelled
when its client goes away first.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from lopa.decoding.generation import SMALLEST_P, StepEvent
from lopa.params import InvalidParameter
from lopa.scheduling.request import (
    Abort,
    Completion,
    Outcome,
    QueueFull,
    Request,
    SchedulerStopped,
)
from lopa.scheduling.scheduler import Scheduler
from lopa.serving.master.admission import Admission, Ask
from lopa.serving.master.errors import GroupUnavailable
from lopa.serving.master.events import Event, Finished, Progress
from lopa.serving.master.failures import (
    CANCELLED,
    DEADLINE,
    INTERNAL,
    INVALID,
    QUEUE_FULL,
    UNAVAILABLE,
    failure_of,
)
from lopa.serving.master.streaming import DeltaTracker
from lopa.serving.shared.metrics import MasterMetrics

log = logging.getLogger("lopa.master")

# A client's deadline starts when it sends, the master's copy of it when it has read the request: a
# cancel this close to the master's deadline is the client's deadline passing, not the client leaving.
CLIENT_DEADLINE_LEAD_S = 0.5

__all__ = ["Dispatcher", "GroupUnavailable", "QueueFull", "Ticket"]


class Ticket:
    """One admitted request on its way through the scheduler, as its API adapter holds it: the
    Request admission made, given the client's deadline and arrival, and its events."""

    def __init__(self, request: Request, stream: bool, loop: asyncio.AbstractEventLoop,
                 count: Callable[[str], None], deadline: float, arrived: float | None = None,
                 deadline_of: str = "") -> None:
        self.request, self.stream, self.loop = request, stream, loop
        request.abort = Abort(deadline=deadline, deadline_of=deadline_of)
        # when the client's request came in (time.perf_counter), where its latencies start
        request.arrived = time.perf_counter() if arrived is None else arrived
        self._items: asyncio.Queue[Event | BaseException] = asyncio.Queue()
        self._count = count
        self._counted = False

    @property
    def abort(self) -> Abort:
        return self.request.abort

    @property
    def arrived(self) -> float:
        return self.request.arrived

    def first_token_sent(self) -> None:
        """The transport wrote the answer's first token to the client: the request's TTFT ends here."""
        if self.request.first_token_sent is None:
            self.request.first_token_sent = time.perf_counter()

    def post(self, item: Event | BaseException) -> None:
        """From the scheduler thread: the next event, or the error that ended the request."""
        self.loop.call_soon_threadsafe(self._items.put_nowait, item)

    async def events(self) -> AsyncIterator[Event]:
        """Progress events (a stream's), then the Finished; raises the error that ended the request.
        Closed or cancelled before the end (the client went away), the request stops between rounds."""
        try:
            while True:
                item = await self._items.get()
                if isinstance(item, Progress):
                    yield item
                    continue
                yield self._settle(item)
                return
        finally:
            self.cancel()

    async def finished(self) -> Finished:
        """The request's Finished, or its error raised; cancelled while waiting, the request stops."""
        async for event in self.events():
            if isinstance(event, Finished):
                return event
        raise AssertionError("a request's events end with its Finished")

    def cancel(self) -> None:
        """The client went away (or its deadline passed): stop the request between rounds, counted
        as cancelled (deadline once it expired) unless its end was already read."""
        if self._counted:
            return
        self.abort.cancelled.set()
        # gRPC cancels the handler when the client's deadline passes, often before the scheduler
        # checks that same deadline between rounds: that is a deadline, not a client cancel.
        deadline = self.abort.deadline
        expired = deadline is not None and time.monotonic() >= deadline - CLIENT_DEADLINE_LEAD_S
        self._count_once((DEADLINE if expired else CANCELLED).label)

    def _settle(self, item: Finished | BaseException) -> Finished:
        if isinstance(item, Finished):
            self._count_once("ok")
            return item
        kind = failure_of(item).kind
        self._count_once(kind.label)
        if kind is INTERNAL:
            log.error("request failed", exc_info=item)
        raise item

    def _count_once(self, label: str) -> None:
        if not self._counted:
            self._counted = True
            self._count(label)


class Dispatcher:
    """The door of the request pipeline: admission, the queue, and each request's events."""

    def __init__(
        self,
        admission: Admission,
        scheduler: Scheduler,
        decode: Callable[[list[int]], str],
        metrics: MasterMetrics,
        group_ready: Callable[[], bool],
        request_timeout_s: float,
    ) -> None:
        self.admission, self.scheduler, self.decode, self.metrics = admission, scheduler, decode, metrics
        self.group_ready, self.request_timeout_s = group_ready, request_timeout_s
        self.draining = False  # SIGTERM: no new request; the queued and running ones finish

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    def busy(self) -> bool:
        """Requests queued or decoding (what a drain waits for)."""
        return bool(self.scheduler.waiting or self.scheduler.running)

    def refused(self, label: str, count: int = 1) -> None:
        """Count requests an adapter turned away before admission (a body that does not parse)."""
        self.metrics.requests.labels(label).inc(count)

    async def open(
        self, asks: Sequence[Ask], stream: bool, remaining_s: float | None = None,
        arrived: float | None = None,
    ) -> list[Ticket]:
        """Admit every request (InvalidParameter, InvalidInBatch naming which), then queue all of them
        or none (GroupUnavailable, QueueFull); each refusal counted once per request. `arrived`
        (time.perf_counter): when the transport received the request, where latencies start."""
        arrived = time.perf_counter() if arrived is None else arrived
        try:
            admitted = await asyncio.to_thread(self.admission.admit_all, asks)
        except InvalidParameter:
            self.refused(INVALID.label)
            raise
        return self.submit(admitted, stream, remaining_s, arrived)

    def submit(
        self, admitted: Sequence[Request], stream: bool, remaining_s: float | None = None,
        arrived: float | None = None,
    ) -> list[Ticket]:
        n = len(admitted)
        if self.draining:
            self.refused(UNAVAILABLE.label, n)
            raise GroupUnavailable("the master is shutting down (draining its requests): retry elsewhere", 1)
        if not self.group_ready():
            self.refused(UNAVAILABLE.label, n)
            raise GroupUnavailable("the worker group is not ready (see health)")
        timeout = self.request_timeout_s if remaining_s is None else min(self.request_timeout_s, remaining_s)
        server = timeout == self.request_timeout_s
        whose = (f"limits.request_timeout_s ({timeout:g} s)" if server
                 else f"the client's deadline ({timeout:.3g} s left when it arrived)")
        loop = asyncio.get_running_loop()
        count = self.metrics.requests.labels
        tickets = [Ticket(one, stream, loop, lambda label: count(label).inc(), time.monotonic() + timeout,
                          arrived, whose) for one in admitted]
        try:
            self.scheduler.submit_many([self._request(ticket) for ticket in tickets])
        except QueueFull:
            self.refused(QUEUE_FULL.label, n)
            raise
        except SchedulerStopped as error:  # stopping between the drain check and the queue
            self.refused(UNAVAILABLE.label, n)
            raise GroupUnavailable(str(error), 1) from None
        return tickets

    def _request(self, ticket: Ticket) -> Request:
        """The ticket's request with its client's callbacks: a stream's deltas, the end."""
        request = ticket.request
        ends = request.stop.end_ids(self.scheduler.decoder.eos_ids)
        prompt_length = len(request.prompt_ids)
        answer_end = prompt_length + request.params.max_new_tokens  # the rest of the last block is cut
        tracker = DeltaTracker(self.decode, ends, request.stop, prompt_length, answer_end)
        mask_id = self.scheduler.decoder.mask_id

        def on_step(event: StepEvent) -> None:
            offset, ids, text = tracker.step(event.tokens, mask_id)
            fills = [(p - prompt_length, t) for p, t in event.fills]
            filled = [event.filled.get(prompt_length + offset + i) for i in range(len(ids))]
            logprobs = [0.0 if f is None else math.log(max(f.prob, SMALLEST_P)) for f in filled]
            asked = request.top_logprobs
            alternatives = [() if f is None else f.alternatives for f in filled] if asked else []
            ticket.post(Progress(event.step, offset, ids, text, fills, event.candidates, event.winner,
                                 event.granted_branches, logprobs, alternatives))

        def on_done(outcome: Outcome) -> None:
            item: Any = outcome
            if isinstance(outcome, Completion):
                try:
                    if ticket.stream:
                        offset, ids, text = tracker.finish(outcome.text, list(outcome.result.output_ids))
                        item = Finished(outcome, offset, ids, text)
                    else:
                        item = Finished(outcome)
                except Exception as error:  # no end event: the request ends with this error, never hangs
                    log.exception("the end of a stream could not be built")
                    item = error
            ticket.post(item)

        request.on_step = on_step if ticket.stream else None
        request.on_done = on_done
        return request


def merged_events(
    tickets: list[Ticket],
) -> tuple[asyncio.Queue[tuple[int, Progress | Finished | Exception]], list[asyncio.Task]]:
    """Every ticket's events in one queue as they come, (choice index, the event or the error that
    ended it), and the tasks that feed it (cancel them to stop the requests)."""
    merged: asyncio.Queue[tuple[int, Progress | Finished | Exception]] = asyncio.Queue()

    async def pump(index: int, ticket: Ticket) -> None:
        try:
            async for event in ticket.events():
                merged.put_nowait((index, event))
        except Exception as error:
            merged.put_nowait((index, error))

    return merged, [asyncio.create_task(pump(i, ticket)) for i, ticket in enumerate(tickets)]
