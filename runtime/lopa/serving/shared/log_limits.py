"""Logs that stay readable under abuse: a repeated error is one line per interval, not a flood.

asyncio logs `socket.accept() out of system resource` with a traceback at every failed accept:
out of descriptors, that was hundreds of thousands of lines in seconds. `limit_repeats` keeps one
line per interval (with a count of those left out) and drops the traceback.
"""

from __future__ import annotations

import logging
import resource
import time

ACCEPT_FAILURE = "socket.accept() out of system resource"


class RepeatLimit(logging.Filter):
    """Passes the first record whose message starts with `prefix` in each interval, without its
    traceback and with the count of those left out since; other records pass untouched."""

    def __init__(self, prefix: str, interval_s: float = 10.0) -> None:
        super().__init__()
        self.prefix, self.interval_s = prefix, interval_s
        self._last, self._left_out = float("-inf"), 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.prefix):
            return True
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._left_out += 1
            return False
        record.msg = f"{record.getMessage()} ({self._left_out} more in the last {self.interval_s:g} s)"
        record.args, record.exc_info, record.exc_text = (), None, None
        self._last, self._left_out = now, 0
        return True


def limit_repeats(interval_s: float = 10.0) -> None:
    """Install the limits this process needs (idempotent)."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, RepeatLimit) for f in logger.filters):
        logger.addFilter(RepeatLimit(ACCEPT_FAILURE, interval_s))


def raise_descriptor_limit() -> int:
    """Lift the soft limit of open descriptors to the hard one (many containers start at 1024):
    connections are bounded per port, not by running out. Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            return hard
        except (ValueError, OSError):
            pass
    return soft
