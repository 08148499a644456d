"""A request as the scheduler holds it, and what it becomes (pure data, thread-safe aborts)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from lopa.decoding.generation import GenerationResult, StepEvent
from lopa.params import DecodingParams
from lopa.stops import StopPolicy


class RequestAborted(RuntimeError):
    """The client cancelled or the deadline passed; checked between rounds."""

    def __init__(self, reason: str, deadline: bool = False) -> None:
        super().__init__(reason)
        self.deadline = deadline


class QueueFull(RuntimeError):
    """The waiting queue is at limits.queue_size (RESOURCE_EXHAUSTED)."""


class SchedulerStopped(RuntimeError):
    """The scheduler is stopping or stopped: a request is refused, or ends unserved (UNAVAILABLE:
    another server may take it)."""


@dataclass
class Abort:
    """What aborts a request (set from the client's side, read by the scheduler between rounds)."""

    cancelled: threading.Event = field(default_factory=threading.Event)
    deadline: float | None = None  # time.monotonic()
    deadline_of: str = ""  # whose deadline it is, for the message ("limits.request_timeout_s (300 s)")

    def check(self) -> None:
        if self.cancelled.is_set():
            raise RequestAborted("cancelled by the client")
        if self.deadline is not None and time.monotonic() > self.deadline:
            whose = f": {self.deadline_of}" if self.deadline_of else ""
            raise RequestAborted(f"deadline exceeded{whose}", deadline=True)


@dataclass(frozen=True)
class Completion:
    text: str
    result: GenerationResult
    finish_reason: str  # "eos", "stop" or "length"
    queue_s: float = 0.0  # arrival to admission into a batch
    ttft_s: float = 0.0  # arrival to the first generated token (0 when none)


Outcome = Completion | Exception


@dataclass
class Request:
    """A request its entry point checked (lopa.serving.master.admission, LocalEngine.generate);
    the callbacks run on the scheduler thread."""

    prompt_ids: list[int]
    params: DecodingParams
    stop: StopPolicy = field(default_factory=StopPolicy)  # stop strings and stop tokens
    pin_branches: bool = False  # never grant fewer branches than asked: wait for room instead
    ignore_eos: bool = False  # never fill an end token: the answer is max_new_tokens long
    top_logprobs: int = 0  # each answer token's most probable alternatives kept (GenerationResult)
    on_step: Callable[[StepEvent], None] | None = None
    on_done: Callable[[Outcome], None] | None = None
    abort: Abort = field(default_factory=Abort)
    arrived: float = field(default_factory=time.perf_counter)
    # When the answer's first token was written to the client's stream (set by the transport):
    # a stream's TTFT ends there, where its client sees it; None: at the round that committed it.
    first_token_sent: float | None = None

    def __post_init__(self) -> None:
        self.params = self.params.seeded()  # the seed it samples with, whichever executor runs it


class Waiter:
    """on_done for a caller that blocks until the outcome (the local engine)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._outcome: Outcome | None = None

    def __call__(self, outcome: Outcome) -> None:
        self._outcome = outcome
        self._done.set()

    def outcome(self, timeout: float | None = None) -> Outcome | None:
        """The outcome once settled (None if `timeout` seconds passed first)."""
        self._done.wait(timeout)
        return self._outcome

    def wait(self) -> Completion:
        outcome = self.outcome()
        if isinstance(outcome, Exception):
            raise outcome
        assert outcome is not None
        return outcome
