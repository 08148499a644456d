"""The failures a request meets on the master's side of the scheduler, named without a transport.

Each API adapter maps them onto its own codes (gRPC UNAVAILABLE, HTTP 503); dispatch counts them as
"unavailable" in lopa_requests_total.
"""

from __future__ import annotations

GROUP_RETRY_AFTER_S = 5  # a lost group re-forms in seconds (its workers restart and rejoin)


class GroupUnavailable(Exception):
    """No worker group is attached, or the master is draining: a request cannot be queued.
    retry_after_s: when a client may try again (a draining master: at once, elsewhere)."""

    def __init__(self, message: str, retry_after_s: int = GROUP_RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class WorkerLost(RuntimeError):
    """A worker stream failed or timed out: the request fails with UNAVAILABLE. busy: the worker
    refused the stream because another master's is attached (its group is fine: never tell it to
    leave)."""

    def __init__(self, message: str, busy: bool = False) -> None:
        super().__init__(message)
        self.busy = busy
