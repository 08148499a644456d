"""The HTTP API's listening port, bounded: connections, their idle time, their errors.

aiohttp alone keeps a connection that never sends a whole request open for good (no header
timeout), keeps idle ones for an hour and accepts as many as the process has descriptors. Here:

- A new connection must send a request head within `header_timeout_s`; between requests a kept
  connection may idle `keepalive_timeout_s`. Past either it is closed.
- At most `max_connections` are open. At the limit a new connection takes the place of the oldest
  idle one (a request in progress is never cut), so /health still gets in under a flood of idle
  connections; when every one is busy the new one is closed at once. One log line per interval
  says how many were turned away.
- Errors aiohttp answers itself (a malformed request line, a header too long) have OpenAI's error
  shape, log one line without a traceback, and no response names the server's software version.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger("lopa.master")
SERVER_HEADER = "lopa"  # no software or version: nothing for a scanner to match
REFUSAL_LOG_INTERVAL_S = 10.0
# Under a burst of connections the kernel's accept queue must be deep (a dropped SYN costs its client
# a second), while asyncio accepts few per wakeup (it uses one number for both): between two
# batches it reads the requests already in, so a new /health is served before a flood can evict it.
KERNEL_BACKLOG = 4096
ACCEPTS_PER_WAKEUP = 64


@dataclass(frozen=True)
class HttpBounds:
    max_connections: int = 1024
    header_timeout_s: float = 10.0  # a new connection's first request head
    keepalive_timeout_s: float = 75.0  # an idle connection between requests
    body_timeout_s: float = 30.0  # a request body, once its head arrived


class ConnectionGuard:
    """The port's open connections: idle ones on a deadline, oldest first; busy ones serving a request."""

    def __init__(self, bounds: HttpBounds, loop: asyncio.AbstractEventLoop) -> None:
        self.bounds, self.loop = bounds, loop
        self._idle: dict[RequestHandler, asyncio.TimerHandle] = {}  # insertion order: oldest first
        self._busy: set[RequestHandler] = set()
        self._turned_away = 0
        self._logged_at = 0.0

    @property
    def open(self) -> int:
        return len(self._idle) + len(self._busy)

    def opened(self, handler: RequestHandler) -> None:
        if self.open >= self.bounds.max_connections:
            self._turned_away += 1
            self._log_refusals()
            if not self._idle:  # every connection serves a request: this one waits for none
                _close(handler)
                return
            self._expire(next(iter(self._idle)))  # the oldest idle one makes room
        self._arm(handler, self.bounds.header_timeout_s)

    def busy(self, handler: RequestHandler) -> None:
        timer = self._idle.pop(handler, None)
        if timer is not None:
            timer.cancel()
        self._busy.add(handler)

    def idle(self, handler: RequestHandler) -> None:
        if handler in self._busy:
            self._busy.discard(handler)
            self._arm(handler, self.bounds.keepalive_timeout_s)

    def closed(self, handler: RequestHandler) -> None:
        timer = self._idle.pop(handler, None)
        if timer is not None:
            timer.cancel()
        self._busy.discard(handler)

    def _arm(self, handler: RequestHandler, seconds: float) -> None:
        self._idle[handler] = self.loop.call_later(seconds, self._expire, handler)

    def _expire(self, handler: RequestHandler) -> None:
        self.closed(handler)
        _close(handler)

    def _log_refusals(self) -> None:
        now = time.monotonic()
        if now - self._logged_at >= REFUSAL_LOG_INTERVAL_S:
            log.warning("HTTP port at its limit of %d connections (master.http_max_connections): %d turned "
                        "away or evicted while idle in the last %.0f s", self.bounds.max_connections,
                        self._turned_away, REFUSAL_LOG_INTERVAL_S)
            self._logged_at, self._turned_away = now, 0


def _close(handler: RequestHandler) -> None:
    if handler.transport is not None:
        handler.transport.close()


class GuardedHandler(RequestHandler):
    """aiohttp's connection handler, reporting to the guard and answering its own errors OpenAI's way."""

    def __init__(self, manager: Any, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.guard = guard

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.guard.opened(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.guard.closed(self)
        super().connection_lost(exc)

    def log_exception(self, message: str, *args: Any, **kwargs: Any) -> None:
        """A client that went away or sent a broken request is an ordinary event: one line, no traceback."""
        error = kwargs.get("exc_info")
        if isinstance(error, (ConnectionError, HttpProcessingError, asyncio.CancelledError)):
            log.info("%s: %s", message % args if args else message, type(error).__name__)
            return
        super().log_exception(message, *args, **kwargs)

    def handle_error(
        self, request: Any, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        """A request aiohttp could not parse or serve: one log line, OpenAI's error shape."""
        reason = message or (type(exc).__name__ if exc else "error")
        log.info("HTTP %d to %s: %s", status, getattr(request, "remote", "?"), reason.splitlines()[0][:200])
        kind = "invalid_request_error" if status < 500 else "server_error"
        body = {"error": {"message": reason.splitlines()[0][:200], "type": kind, "param": None, "code": None}}
        response = web.Response(status=status, text=json.dumps(body), content_type="application/json",
                                headers={"Server": SERVER_HEADER})
        response.force_close()
        return response


def guard_middleware(guard: ConnectionGuard) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Marks the connection busy while its request is served (its idle deadline is off meanwhile)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Callable[..., Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        protocol = request.protocol
        if isinstance(protocol, RequestHandler):
            guard.busy(protocol)
        try:
            return await handler(request)
        finally:
            if isinstance(protocol, RequestHandler):
                guard.idle(protocol)

    return middleware


async def no_server_version(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = SERVER_HEADER


class BoundedSite(web.TCPSite):
    """A TCPSite whose connections the guard bounds (see the module docstring)."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, guard: ConnectionGuard,
                 handler_args: dict[str, Any], ssl_context: ssl.SSLContext | None = None) -> None:
        super().__init__(runner, host, port, ssl_context=ssl_context, backlog=ACCEPTS_PER_WAKEUP,
                         reuse_port=False)
        self.guard, self.handler_args = guard, handler_args

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()

        def factory() -> GuardedHandler:
            return GuardedHandler(server, self.guard, loop=loop, **self.handler_args)

        listening = socket.create_server((self._host, self._port), backlog=KERNEL_BACKLOG)
        self._server = await loop.create_server(factory, sock=listening, ssl=self._ssl_context,
                                                backlog=self._backlog)
        listening.listen(KERNEL_BACKLOG)  # asyncio listened with its per-wakeup count
