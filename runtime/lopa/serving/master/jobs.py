"""The master's side of the request pipeline: gRPC jobs in, the shared Scheduler decides.

The gRPC handlers (asyncio) submit a Job and await its outcome (and, when streaming, its chunks);
the scheduler thread (lopa.scheduling.scheduler) batches every running request's rounds over the
DistributedExecutor and posts chunks and outcomes back to the event loop. Prometheus sees the
queue, the KV slots and every round through MasterObserver.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lopa.decoding.decoder import StepEvent
from lopa.proto import lopa_pb2
from lopa.scheduling.request import Abort, Completion, Outcome, QueueFull, Request
from lopa.scheduling.scheduler import Observer, Scheduler
from lopa.serving.master.requests import ValidRequest
from lopa.serving.master.streaming import DeltaTracker
from lopa.serving.shared.metrics import MasterMetrics

log = logging.getLogger("lopa.master")

__all__ = ["GroupUnavailable", "Job", "JobRunner", "MasterObserver", "QueueFull", "stats_of"]


class GroupUnavailable(Exception):
    """No worker group is attached: a request cannot be queued."""


@dataclass
class Job:
    submitted: ValidRequest
    loop: asyncio.AbstractEventLoop
    stream: bool = False
    abort: Abort = field(default_factory=Abort)
    arrived: float = field(default_factory=time.perf_counter)
    chunks: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    done: asyncio.Future[Any] | None = None

    def __post_init__(self) -> None:
        self.done = self.loop.create_future()

    def post(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.chunks.put_nowait, item)

    def finish(self, outcome: Any) -> None:
        def settle() -> None:
            if self.done is not None and not self.done.done():
                self.done.set_result(outcome)
            self.chunks.put_nowait(outcome)

        self.loop.call_soon_threadsafe(settle)


def stats_of(completion: Completion) -> lopa_pb2.Stats:
    result = completion.result
    return lopa_pb2.Stats(
        forwards=result.forwards,
        tokens=result.tokens,
        generated_positions=len(result.generated_ids),
        tpf=result.tpf,
        padded_tpf=result.padded_tpf,
        tokens_per_s=result.tokens_per_s,
        wall_s=result.wall_s,
        ttft_s=completion.ttft_s,
        queue_s=completion.queue_s,
        mean_branches=result.mean_branches,
        verified_tokens=result.verified_tokens,
    )


class MasterObserver(Observer):
    """The scheduler's hooks -> the master's Prometheus metrics."""

    def __init__(self, metrics: MasterMetrics) -> None:
        self.metrics = metrics

    def occupancy(self, waiting: int, running: int, slots: int) -> None:
        m = self.metrics
        m.queue_depth.set(waiting)
        m.running.set(running)
        m.kv_slot_usage.set(running / slots if slots else 0.0)

    def admitted(self, queue_s: float) -> None:
        self.metrics.queue_seconds.observe(queue_s)

    def round(self, batch: int, granted: Sequence[int], wanted: Sequence[int]) -> None:
        self.metrics.batch_size.observe(batch)
        for g in granted:
            self.metrics.branches_granted.observe(g)
        self.metrics.branches_cut.inc(sum(w - g for w, g in zip(wanted, granted, strict=True) if w > g))

    def finished(self, request: Request, outcome: Outcome) -> None:
        latency = time.perf_counter() - request.arrived
        self.metrics.request_seconds.observe(latency)
        if isinstance(outcome, Completion):
            result = outcome.result
            if outcome.ttft_s > 0:  # 0: no round committed a token (nothing to time)
                self.metrics.ttft_seconds.observe(outcome.ttft_s)
                if result.tokens > 1:
                    self.metrics.tpot_seconds.observe((latency - outcome.ttft_s) / (result.tokens - 1))
            self.metrics.tokens.inc(result.tokens)
            self.metrics.forwards.inc(result.forwards)
            self.metrics.verified_tokens.inc(result.verified_tokens)
            if result.forwards:
                self.metrics.tpf.observe(result.tpf)


class JobRunner:
    """Turns Jobs into scheduler Requests: stream chunks from the round events, the final chunk and
    the outcome from the completion."""

    def __init__(self, scheduler: Scheduler, decode: Callable[[list[int]], str], mask_id: int) -> None:
        self.scheduler, self.decode, self.mask_id = scheduler, decode, mask_id

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    def submit(self, job: Job) -> None:
        """Queue the job (QueueFull when full; InvalidParameter for what the decoder refuses)."""
        self.submit_many([job])

    def submit_many(self, jobs: Sequence[Job]) -> None:
        """Queue every job or none (Scheduler.submit_many)."""
        self.scheduler.submit_many([self._request(job) for job in jobs])

    def _request(self, job: Job) -> Request:
        submitted = job.submitted
        tracker = DeltaTracker(self.decode, frozenset(self.scheduler.decoder.eos_ids), submitted.stop)
        prompt_length = len(submitted.prompt_ids)

        def on_step(event: StepEvent) -> None:
            offset, ids, text = tracker.step(event.tokens[prompt_length:], self.mask_id)
            job.post(
                lopa_pb2.GenerateChunk(
                    step=event.step,
                    offset=offset,
                    token_ids=ids,
                    text=text,
                    fills=[lopa_pb2.Fill(position=p - prompt_length, token_id=t) for p, t in event.fills],
                    candidates=event.candidates,
                    winner=event.winner,
                    branches=event.branches,
                )
            )

        def on_done(outcome: Outcome) -> None:
            try:
                if isinstance(outcome, Completion) and job.stream:
                    offset, ids, text = tracker.finish(outcome.text, list(outcome.result.output_ids))
                    job.post(
                        lopa_pb2.GenerateChunk(
                            last=True,
                            offset=offset,
                            token_ids=ids,
                            text=text,
                            finish_reason=outcome.finish_reason,
                            stats=stats_of(outcome),
                        )
                    )
            except Exception as error:  # no last chunk: the stream ends with this error, never hangs
                log.exception("the last chunk of a stream could not be built")
                outcome = error
            job.finish(outcome)

        return Request(
            submitted.prompt_ids,
            submitted.params,
            submitted.stop,
            submitted.pin_branches,
            on_step=on_step if job.stream else None,
            on_done=on_done,
            abort=job.abort,
            arrived=job.arrived,
        )
