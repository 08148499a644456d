"""The master's request runner: a bounded queue and ONE decode thread (the workers hold one request).

The gRPC side submits a Job and awaits its result (and, when streaming, its chunks); this thread
runs the Decoder over the DistributedExecutor and posts results back to the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lopa.decoding.decoder import Decoder, GenerationResult, StepEvent
from lopa.proto import lopa_pb2
from lopa.serving.distributed import Abort, DistributedExecutor
from lopa.serving.metrics import MasterMetrics
from lopa.serving.requests import JobSpec
from lopa.serving.streaming import DeltaTracker
from lopa.stops import cut_at_stop, stop_check

log = logging.getLogger("lopa.master")


class QueueFull(RuntimeError):
    pass


@dataclass
class Job:
    spec: JobSpec
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


@dataclass(frozen=True)
class Completion:
    text: str
    result: GenerationResult
    finish_reason: str
    stats: lopa_pb2.Stats


class JobRunner:
    def __init__(
        self,
        decoder: Decoder,
        executor: DistributedExecutor,
        decode: Callable[[list[int]], str],
        queue_size: int,
        metrics: MasterMetrics,
    ) -> None:
        self.decoder, self.executor, self.decode = decoder, executor, decode
        self.metrics = metrics
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._run, name="lopa-decode", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with contextlib.suppress(queue.Full):  # a full queue is drained by the thread anyway
            self._queue.put_nowait(None)

    def submit(self, job: Job) -> None:
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"the request queue is full ({self._queue.maxsize} waiting)") from None
        self.metrics.queue_depth.set(self._queue.qsize())

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            self.metrics.queue_depth.set(self._queue.qsize())
            self.metrics.queue_seconds.observe(time.perf_counter() - job.arrived)
            try:
                job.abort.check()  # cancelled or expired while waiting
                outcome: Any = self._generate(job)
            except Exception as error:  # mapped to a status code by the gRPC side
                outcome = error
            self.metrics.request_seconds.observe(time.perf_counter() - job.arrived)
            job.finish(outcome)

    def _generate(self, job: Job) -> Completion:
        spec, eos = job.spec, self.decoder.eos_ids
        started = time.perf_counter()
        tracker = DeltaTracker(self.decode, frozenset(eos), spec.stop)
        first_token: list[float] = []
        prompt_length = len(spec.prompt_ids)

        def on_step(event: StepEvent) -> None:
            generated = event.tokens[prompt_length:]
            offset, ids, text = tracker.step(generated, self.decoder.mask_id)
            if ids and not first_token:
                first_token.append(time.perf_counter())
            if job.stream:
                job.post(
                    lopa_pb2.GenerateChunk(
                        step=event.step,
                        offset=offset,
                        token_ids=ids,
                        text=text,
                        fills=[lopa_pb2.Fill(position=p - prompt_length, token_id=t) for p, t in event.fills],
                        candidates=event.candidates,
                        winner=event.winner,
                    )
                )

        should_stop = stop_check(self.decode, spec.stop)
        self.executor.abort = job.abort
        result = self.decoder.generate(spec.prompt_ids, spec.params, on_step=on_step, should_stop=should_stop)
        completion = self._complete(job, result, started, first_token[0] if first_token else None)
        if job.stream:
            offset, ids, text = tracker.finish(completion.text, list(completion.result.output_ids))
            job.post(
                lopa_pb2.GenerateChunk(
                    last=True,
                    offset=offset,
                    token_ids=ids,
                    text=text,
                    finish_reason=completion.finish_reason,
                    stats=completion.stats,
                )
            )
        return completion

    def _complete(
        self, job: Job, result: GenerationResult, started: float, first_token: float | None
    ) -> Completion:
        cut = cut_at_stop(result, self.decode, job.spec.stop)
        if cut is not None:
            (text, result), reason = cut, "stop"
        else:
            text = self.decode(result.output_ids)
            eos = bool(result.output_ids) and result.output_ids[-1] in self.decoder.eos_ids
            reason = "eos" if eos else "length"
        stats = lopa_pb2.Stats(
            forwards=result.forwards,
            tokens=result.tokens,
            generated_positions=len(result.generated_ids),
            tpf=result.tpf,
            padded_tpf=result.padded_tpf,
            tokens_per_s=result.tokens_per_s,
            wall_s=result.wall_s,
            ttft_s=(first_token - job.arrived) if first_token is not None else 0.0,
            queue_s=started - job.arrived,
        )
        self.metrics.tokens.inc(result.tokens)
        self.metrics.forwards.inc(result.forwards)
        if result.forwards:
            self.metrics.tpf.observe(result.tpf)
        return Completion(text, result, reason, stats)
