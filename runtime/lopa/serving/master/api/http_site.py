"""The HTTP API's listening port, bounded: connections, their idle time, their errors.

aiohttp alone keeps a connection that never sends a whole request open for good (no header
timeout), keeps idle ones for an hour and accepts as many as the process has descriptors. Here:

- A new connection must send a request head within `header_timeout_s`; between requests a kept
  connection may idle `keepalive_timeout_s`. Past either it is closed.
- The slots are the connection guard's (connection_guard): at the limit idle connections and slow
  bodies give way to new connections, probes have a reserve, one client address has a cap.
- Request bodies are read as sent: a compressed body is not inflated (the API refuses it, 415).
- Errors aiohttp answers itself (a malformed request line, a header too long) have OpenAI's error
  shape, log one line without a traceback, and no response names the server's software version.
  A client that went away logs nothing: there is no one to answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from lopa.serving.master.api.connection_guard import ConnectionGuard

log = logging.getLogger("lopa.master")
SERVER_HEADER = "lopa"  # no software or version: nothing for a scanner to match
# Under a burst of connections the kernel's accept queue must be deep (a dropped SYN costs its client
# a second), while asyncio accepts few per wakeup (it uses one number for both): between two
# batches it reads the requests already in, so a new /health is served before a flood can evict it.
KERNEL_BACKLOG = 4096
ACCEPTS_PER_WAKEUP = 64
RESERVE_RETRY_AFTER_S = 1


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
        if isinstance(error, (ConnectionError, asyncio.CancelledError)):  # gone, or evicted at the limit
            log.debug("%s: %s", message % args if args else message, type(error).__name__)
            return
        if isinstance(error, HttpProcessingError):
            log.info("%s: %s", message % args if args else message, type(error).__name__)
            return
        super().log_exception(message, *args, **kwargs)

    def handle_error(
        self, request: Any, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        """A request aiohttp could not parse or serve: one log line, OpenAI's error shape."""
        if isinstance(exc, ConnectionError):  # the client went away (or was evicted): no one to answer
            log.debug("HTTP client %s gone: %s", getattr(request, "remote", "?"), type(exc).__name__)
            return web.Response(status=status)
        reason = message or (type(exc).__name__ if exc else "error")
        log.info("HTTP %d to %s: %s", status, getattr(request, "remote", "?"), reason.splitlines()[0][:200])
        kind = "invalid_request_error" if status < 500 else "server_error"
        response = json_error(status, reason.splitlines()[0][:200], kind)
        response.headers["Server"] = SERVER_HEADER
        response.force_close()
        return response


def guard_middleware(guard: ConnectionGuard) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Tells the guard when a request starts and ends (its idle deadline is off meanwhile); a
    connection of the probe reserve gets a 503 for anything but a probe, and is closed after it."""

    @web.middleware
    async def middleware(request: web.Request, handler: Callable[..., Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        protocol = request.protocol
        if not isinstance(protocol, RequestHandler):
            return await handler(request)
        try:
            if not guard.busy(protocol, request.content, request.path):
                response = json_error(503, "the server is at its connection limit; retry",
                                      "service_unavailable")
                response.headers["Retry-After"] = str(RESERVE_RETRY_AFTER_S)
                response.force_close()
                return response
            response = await handler(request)
            if guard.reserved(protocol):
                response.force_close()
            return response
        finally:
            guard.idle(protocol)

    return middleware


def json_error(status: int, message: str, kind: str) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return web.Response(status=status, text=json.dumps(body), content_type="application/json")


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

        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        listening = socket.create_server((self._host, self._port), family=family, backlog=KERNEL_BACKLOG)
        self._server = await loop.create_server(factory, sock=listening, ssl=self._ssl_context,
                                                backlog=self._backlog)
        listening.listen(KERNEL_BACKLOG)  # asyncio listened with its per-wakeup count
