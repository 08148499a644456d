"""Every way a request fails, and what each client API answers for it: one table, one lookup.

| kind        | lopa_requests_total | HTTP | OpenAI type           | gRPC               | retry after      |
|-------------|---------------------|------|-----------------------|--------------------|------------------|
| invalid     | invalid             | 400  | invalid_request_error | INVALID_ARGUMENT   |                  |
| queue full  | rejected            | 429  | rate_limit_exceeded   | RESOURCE_EXHAUSTED | 1 s              |
| unavailable | unavailable         | 503  | service_unavailable   | UNAVAILABLE        | the error's, 5 s |
| deadline    | deadline            | 504  | timeout               | DEADLINE_EXCEEDED  |                  |
| cancelled   | cancelled           | 499  | cancelled             | CANCELLED          |                  |
| internal    | error               | 500  | server_error          | INTERNAL           |                  |

`failure_of` is the only place an error is classified; the HTTP and gRPC adapters render its row
(HTTP: Retry-After; gRPC: the retry pushback trailer). A client is told the error's own message,
but never a worker's address (a lost worker is named by its rank) nor an unexpected error's details
(the master's log has them). No transport is imported here: the gRPC code is its name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lopa.params import InvalidParameter
from lopa.scheduling.request import QueueFull, RequestAborted, SchedulerStopped
from lopa.serving.master.errors import GROUP_RETRY_AFTER_S, GroupUnavailable, WorkerLost

QUEUE_RETRY_AFTER_S = 1  # a full queue drains in about a request's time: retry soon, not at once
INTERNAL_MESSAGE = "internal error (see the master log)"
_RANK = re.compile(r"worker rank \d+")  # what a client may know of a lost worker (not its address)


@dataclass(frozen=True)
class FailureKind:
    """One row of the table."""

    label: str  # the outcome in lopa_requests_total
    http_status: int
    openai_type: str  # the OpenAI error's "type"
    grpc_code: str  # a grpc.StatusCode's name


INVALID = FailureKind("invalid", 400, "invalid_request_error", "INVALID_ARGUMENT")
QUEUE_FULL = FailureKind("rejected", 429, "rate_limit_exceeded", "RESOURCE_EXHAUSTED")
UNAVAILABLE = FailureKind("unavailable", 503, "service_unavailable", "UNAVAILABLE")
DEADLINE = FailureKind("deadline", 504, "timeout", "DEADLINE_EXCEEDED")
CANCELLED = FailureKind("cancelled", 499, "cancelled", "CANCELLED")
INTERNAL = FailureKind("error", 500, "server_error", "INTERNAL")
KINDS = (INVALID, QUEUE_FULL, UNAVAILABLE, DEADLINE, CANCELLED, INTERNAL)


@dataclass(frozen=True)
class Failure:
    """A request's failure as its client is told it."""

    kind: FailureKind
    message: str
    retry_after_s: int | None = None  # when the client may try again
    field: str | None = None  # invalid: the field, in the server's names (each adapter renames it)
    reason: str = ""  # invalid: what is wrong with it


def failure_of(error: BaseException) -> Failure:
    if isinstance(error, InvalidParameter):
        return Failure(INVALID, str(error), field=error.field, reason=error.reason)
    if isinstance(error, QueueFull):
        return Failure(QUEUE_FULL, str(error), QUEUE_RETRY_AFTER_S)
    if isinstance(error, RequestAborted):
        return Failure(DEADLINE if error.deadline else CANCELLED, str(error))
    if isinstance(error, GroupUnavailable):
        return Failure(UNAVAILABLE, str(error), error.retry_after_s)
    if isinstance(error, SchedulerStopped):  # the master stops: another may take it at once
        return Failure(UNAVAILABLE, str(error), 1)
    if isinstance(error, WorkerLost):
        rank = _RANK.search(str(error))
        lost = f"{rank.group()} was lost" if rank else "the worker group was lost"
        message = f"{lost} during this request; the master waits for the group to re-form: retry"
        return Failure(UNAVAILABLE, message, GROUP_RETRY_AFTER_S)
    return Failure(INTERNAL, INTERNAL_MESSAGE)
