"""The master's async client API (Generate, GenerateStream, model info); server.py serves it.

Health is NOT_SERVING until every worker has joined one group (see links.WorkerGroup) and again
as soon as one is lost. Status codes: bad input INVALID_ARGUMENT (naming the field), full queue
RESOURCE_EXHAUSTED, lost or missing workers UNAVAILABLE, deadline DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from enum import Enum
from pathlib import Path
from typing import Any

import grpc

from lopa import __version__
from lopa.decoding.decoder import Decoder
from lopa.model.config import DreamConfig
from lopa.model.loader import resolve_special_ids
from lopa.model.tokenizer import chat_prompt_ids, load_tokenizer
from lopa.params import DecodingParams, InvalidParameter
from lopa.proto import lopa_pb2, lopa_pb2_grpc
from lopa.scheduling.budget import Budget, default_budget, measured_on
from lopa.scheduling.request import Completion, QueueFull, RequestAborted, SchedulerStopped
from lopa.scheduling.scheduler import Scheduler
from lopa.serving.master.distributed import DistributedExecutor, StepTiming
from lopa.serving.master.jobs import GroupUnavailable, Job, JobRunner, MasterObserver, stats_of
from lopa.serving.master.links import WorkerGroup, WorkerLost
from lopa.serving.master.requests import (
    ValidRequest,
    build_params,
    check_budget,
    check_prompt,
    check_stop,
    usable_limits,
)
from lopa.serving.master.undecodable import Undecodable
from lopa.serving.shared.config import ServingConfig
from lopa.serving.shared.metrics import MasterMetrics
from lopa.serving.shared.model_dir import usable_max_length

log = logging.getLogger("lopa.master")
SERVICE = "lopa.v1.Lopa"


class InvalidInBatch(InvalidParameter):
    """The InvalidParameter of request `index` of those opened together."""

    def __init__(self, index: int, error: InvalidParameter) -> None:
        super().__init__(error.field, error.reason)
        self.index = index


class LopaService(lopa_pb2_grpc.LopaServicer):
    def __init__(self, config: ServingConfig, path: Path, group: WorkerGroup, metrics: MasterMetrics) -> None:
        self.config, self.group, self.metrics = config, group, metrics
        self.model_name = str(path)
        self.model_config = DreamConfig.from_dir(path)
        self.tokenizer = load_tokenizer(path)
        self.special = resolve_special_ids(self.model_config, self.tokenizer, path)
        self.max_length = usable_max_length(config, path)
        self.limits = usable_limits(config.limits, self.max_length)  # what GetModelInfo advertises
        limits = config.limits
        group.expected = (self.model_config.vocab_size, self.max_length, limits.max_batch)
        self.executor = DistributedExecutor(
            group, config.workers.step_timeout_s, self._observe_step, limits.max_batch
        )
        decoder = Decoder(self.executor, self.special.mask, self.special.eos, self.max_length)
        self.budget = (
            Budget(limits.max_step_tokens) if limits.max_step_tokens
            else default_budget(config.model.device)
        )
        scheduler = Scheduler(
            decoder, self.executor, self.decode, limits.queue_size, self.budget, MasterObserver(metrics)
        )
        self.runner = JobRunner(scheduler, self.decode, self.special.mask)
        self.draining = False  # SIGTERM: no new request; the queued and running ones finish

    def adopt_budget(self, measured: Sequence[int]) -> None:
        """Run the budget the joined workers measured at start (see measured_budget)."""
        budget = measured_budget(self.config.limits.max_step_tokens, measured, self.config.model.device)
        if budget is None:
            return
        self.budget = self.runner.scheduler.budget = budget
        how = (f"measured by the workers at start: {', '.join(map(str, measured))} tokens"
               if min(measured, default=0) > 0 else "a worker did not measure it: the fixed default")
        log.info("branch budget: %s (%s)", budget.describe(), how)

    def busy(self) -> bool:
        """Requests queued or decoding (what a drain waits for)."""
        scheduler = self.runner.scheduler
        return bool(scheduler.waiting or scheduler.running)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _observe_step(self, timing: StepTiming) -> None:
        self.metrics.step_seconds.labels("forward").observe(timing.forward_s)
        self.metrics.step_seconds.labels("commit").observe(timing.commit_s)
        self.metrics.step_seconds.labels("coordination").observe(timing.coordination_s)

    # -- RPCs ---------------------------------------------------------------------------------------

    async def Generate(self, request: lopa_pb2.GenerateRequest, context: Any) -> lopa_pb2.GenerateResponse:
        job = await self._submit(request, context, stream=False)
        assert job.done is not None
        outcome = await self._await(job, job.done, context)
        completion = await self._settle(outcome, context)
        return lopa_pb2.GenerateResponse(
            text=completion.text,
            token_ids=completion.result.output_ids,
            finish_reason=completion.finish_reason,
            stats=stats_of(completion),
        )

    async def GenerateStream(
        self, request: lopa_pb2.GenerateRequest, context: Any
    ) -> AsyncIterator[lopa_pb2.GenerateChunk]:
        job = await self._submit(request, context, stream=True)
        async for chunk in job_chunks(job, lambda outcome: self._settle(outcome, context), self.cancelled):
            yield chunk

    async def GetModelInfo(self, request: lopa_pb2.ModelInfoRequest, context: Any) -> lopa_pb2.ModelInfo:
        await self._refuse_undecodable(request, context)
        d, limits = self.config.decoding, self.limits
        return lopa_pb2.ModelInfo(
            model=self.model_name,
            vocab_size=self.model_config.vocab_size,
            max_length=self.max_length,
            workers=self.group.size,
            backend=self.config.workers.backend,
            max_branches=limits.max_branches,
            max_new_tokens=limits.max_new_tokens,
            max_prompt_tokens=limits.max_prompt_tokens,
            default_max_new_tokens=d.max_new_tokens,
            defaults=defaults_message(d),
            server_version=__version__,
        )

    # -- helpers ------------------------------------------------------------------------------------

    def open_job(self, request: lopa_pb2.GenerateRequest, stream: bool, remaining_s: float | None) -> Job:
        """Validate and queue one request, whatever its transport (gRPC or HTTP): InvalidParameter
        naming the field, GroupUnavailable, or QueueFull; counted in the request metrics."""
        return self.open_jobs([request], stream, remaining_s)[0]

    def open_jobs(
        self, requests: Sequence[lopa_pb2.GenerateRequest], stream: bool, remaining_s: float | None
    ) -> list[Job]:
        """open_job for several (an HTTP batch): all valid (else InvalidInBatch, naming which, counted
        once), then all queued or none."""
        n = len(requests)
        submitted = []
        for index, request in enumerate(requests):
            try:
                submitted.append(self._validate(request))
            except InvalidParameter as error:
                self.metrics.requests.labels("invalid").inc()
                raise InvalidInBatch(index, error) from None
        if self.draining:
            self.metrics.requests.labels("unavailable").inc(n)
            raise GroupUnavailable("the master is shutting down (draining its requests): retry elsewhere")
        if not self.group.attached:
            self.metrics.requests.labels("unavailable").inc(n)
            raise GroupUnavailable("the worker group is not ready (see health)")
        timeout = self.config.limits.request_timeout_s
        if remaining_s is not None:
            timeout = min(timeout, remaining_s)
        jobs = [Job(one, asyncio.get_running_loop(), stream=stream) for one in submitted]
        for job in jobs:
            job.abort.deadline = time.monotonic() + timeout
        try:
            self.runner.submit_many(jobs)
        except InvalidParameter:
            self.metrics.requests.labels("invalid").inc(n)
            raise
        except QueueFull:
            self.metrics.requests.labels("rejected").inc(n)
            raise
        except SchedulerStopped as error:  # stopping between the drain check and the queue
            self.metrics.requests.labels("unavailable").inc(n)
            raise GroupUnavailable(str(error)) from None
        return jobs

    def settle(self, outcome: Any) -> Completion | BaseException:
        """A job's outcome, counted: the Completion, or the error to report (see status_of)."""
        if isinstance(outcome, Completion):
            self.metrics.requests.labels("ok").inc()
            return outcome
        label = status_of(outcome)[1]
        self.metrics.requests.labels(label).inc()
        if label == "error":
            log.error("request failed", exc_info=outcome)
        return outcome

    def cancelled(self, job: Job) -> None:
        """The client went away (or its deadline passed): stop the job between rounds."""
        job.abort.cancelled.set()
        # gRPC cancels the handler when the client's deadline passes, often before the scheduler
        # checks that same deadline between rounds: that is a deadline, not a client cancel.
        expired = job.abort.deadline is not None and time.monotonic() >= job.abort.deadline
        self.metrics.requests.labels("deadline" if expired else "cancelled").inc()

    async def _submit(self, request: lopa_pb2.GenerateRequest, context: Any, stream: bool) -> Job:
        await self._refuse_undecodable(request, context)
        try:
            return self.open_job(request, stream, context.time_remaining())
        except InvalidParameter as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except GroupUnavailable as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        except QueueFull as error:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        raise AssertionError("unreachable")

    async def _refuse_undecodable(self, request: Any, context: Any) -> None:
        if isinstance(request, Undecodable):
            self.metrics.requests.labels("invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)

    def _validate(self, request: lopa_pb2.GenerateRequest) -> ValidRequest:
        if request.prompt and request.prompt_token_ids:
            raise InvalidParameter("prompt", "set either prompt or prompt_token_ids, not both")
        params = build_params(request, self.config.decoding, self.limits)
        if request.prompt_token_ids:
            ids = list(request.prompt_token_ids)
        elif request.chat and request.prompt:
            ids = chat_prompt_ids(self.tokenizer, request.prompt)
        else:
            text = request.prompt
            ids = list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []
        from_text = not request.prompt_token_ids
        check_prompt(ids, self.model_config.vocab_size, self.special.mask, self.limits, from_text)
        check_budget(len(ids), params, self.max_length, request)
        return ValidRequest(ids, params, check_stop(list(request.stop)), request.pin_branches)

    async def _await(self, job: Job, awaitable: Any, context: Any) -> Any:
        try:
            return await awaitable
        except asyncio.CancelledError:  # client cancelled or its deadline passed: stop between steps
            self.cancelled(job)
            raise

    async def _settle(self, outcome: Any, context: Any) -> Completion:
        settled = self.settle(outcome)
        if isinstance(settled, Completion):
            return settled
        await context.abort(status_of(settled)[0], str(settled))
        raise AssertionError("unreachable")


async def job_chunks(
    job: Job, settle: Callable[[Any], Awaitable[Any]], gone: Callable[[Job], None]
) -> AsyncIterator[lopa_pb2.GenerateChunk]:
    """A streaming job's chunks until its outcome, which goes to `settle`. When the client goes away
    first, cancelled while waiting for a chunk or closed while one was being written (grpc.aio
    closes the generator at its yield), `gone(job)` stops the job: its slot is not held to the end.
    A job that ended before its client read the end (its deadline passed in the same moment) is
    counted by `gone` too: every request is counted once, by `settle` or by `gone`."""
    assert job.done is not None
    settled = False
    try:
        while True:
            item = await job.chunks.get()
            if isinstance(item, lopa_pb2.GenerateChunk):
                yield item
                continue
            settled = True
            await settle(item)
            return
    finally:
        if not settled:
            gone(job)


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status of a request that failed, and its outcome label in the metrics."""
    if isinstance(error, InvalidParameter):
        return grpc.StatusCode.INVALID_ARGUMENT, "invalid"
    if isinstance(error, (WorkerLost, SchedulerStopped)):
        return grpc.StatusCode.UNAVAILABLE, "unavailable"
    if isinstance(error, RequestAborted):
        return (grpc.StatusCode.DEADLINE_EXCEEDED, "deadline") if error.deadline else (
            grpc.StatusCode.CANCELLED, "cancelled")
    return grpc.StatusCode.INTERNAL, "error"


def defaults_message(d: DecodingParams) -> lopa_pb2.DecodingOverrides:
    """Every override field of the wire, set to the server's default (derived: a new setting needs
    no edit here)."""
    values = {}
    for name in lopa_pb2.DecodingOverrides.DESCRIPTOR.fields_by_name:
        value = getattr(d, name)
        values[name] = value.value if isinstance(value, Enum) else value
    return lopa_pb2.DecodingOverrides(**values)


def measured_budget(configured: int, measured: Sequence[int], device: str) -> Budget | None:
    """The budget a group runs once its workers joined, None to keep the current one. With
    limits.max_step_tokens = 0 on an accelerator every worker measures its forwards at start
    (lopa.scheduling.calibration) and the group runs the smallest (each worker runs its share of a
    round's rows, so the slowest sets it); when one could not measure, the device's fixed default
    (a re-attached group never keeps a budget that its new workers did not measure). CPU workers
    measure nothing: their default stays."""
    if configured:
        return None
    if measured and min(measured) > 0:
        return Budget(min(measured))
    return default_budget(device) if measured_on(device) else None
