"""The master's OpenAI-compatible HTTP API (aiohttp, on the master's own asyncio loop).

    POST /v1/completions        POST /v1/chat/completions   (stream: true -> server-sent events)
    GET  /v1/models, /v1/models/{id}    GET /health (200 once the group serves, else 503)   GET /live
    GET  /metrics (the master's Prometheus metrics: where the inference gateway scrapes)
    vLLM's: POST /tokenize, /detokenize (openai_tokens)   GET /version   GET|POST /ping (as /health)

With API keys (api_keys) every path but the probes, /version and /metrics needs one.

Why aiohttp: it runs on the event loop grpc.aio already drives in the master, so an HTTP request
enters the very same Dispatcher.open as a gRPC one (one queue, one validation, one set of
limits and metrics), with no second server thread; it is already in the stack (kopf) and streams
server-sent events with a plain StreamResponse.

Errors use OpenAI's shape (openai_errors); answers and streams are openai_stream's. A client that
disconnects cancels its request.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web
from aiohttp.web_log import AccessLogger
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from lopa import __version__
from lopa.model.tokenizer import NO_CHAT_TEMPLATE
from lopa.params import InvalidParameter
from lopa.scheduling.request import Completion, QueueFull
from lopa.serving.master.admission import InvalidInBatch
from lopa.serving.master.api import bounded_json
from lopa.serving.master.api.api_keys import key_middleware
from lopa.serving.master.api.connection_guard import ConnectionGuard, HttpBounds
from lopa.serving.master.api.http_site import BoundedSite, guard_middleware, no_server_version
from lopa.serving.master.api.openai_body import (
    Parsed,
    UnknownModel,
    body_field,
    chat_request,
    completion_request,
)
from lopa.serving.master.api.openai_errors import error_response, failure, invalid, openai_errors
from lopa.serving.master.api.openai_stream import FINISH, lopa_stats, stream, token_logprobs, total_usage
from lopa.serving.master.api.openai_tokens import TokenEndpoints, not_found
from lopa.serving.master.dispatch import Dispatcher, GroupUnavailable
from lopa.serving.shared.config import TlsConfig
from lopa.serving.shared.listen import PortTaken
from lopa.serving.shared.tls import ssl_context

__all__ = ["OpenAIApi", "failure", "start_http"]

log = logging.getLogger("lopa.master")
HEALTH_RETRY_AFTER_S = 5  # a group forms or re-forms in seconds
INLINE_BODY_BYTES = 1 << 16  # a larger body is parsed off the event loop, by one thread
SHUTDOWN_S = 5.0  # at shutdown, what a request in flight is given to end (a stream: its error event)
# client address, request line, status, response bytes, seconds (aiohttp's access log format)
ACCESS_LOG_FORMAT = '%a "%r" %s %b %Tfs'
UNLOGGED_PATHS = frozenset({"/health", "/live", "/ping", "/metrics"})
NO_TEMPLATE_HINT = "the model has no chat template; send a plain prompt to /v1/completions"


def parse_body(raw: bytes, charset: str | None, chat: bool, model: str | Sequence[str], max_prompts: int,
               max_values: int) -> tuple[Parsed, Any]:
    """A body's bytes -> the requests it asks for, and the JSON they came from (pure: run off the
    event loop for a large body). Each step is bounded before it builds anything: the JSON's values
    (bounded_json), a batch's prompts (completion_request)."""
    body = bounded_json.loads(raw.decode(charset or "utf-8"), max_values)
    parsed = chat_request(body, model) if chat else completion_request(body, model, max_prompts)
    return parsed, body


def _json_type(content_type: str) -> bool:
    return content_type == "application/json" or content_type.endswith("+json")


class AnsweredAccessLog(AccessLogger):
    """aiohttp's access log, for the API requests that were answered: the probes and the scrapes
    (every few seconds each) have none, and a client that went away, or gave way to another at the
    connection limit, got no answer and has no line (the connection guard counts it in
    lopa_http_connections_refused_total), so that a flood cannot flood the log."""

    def log(self, request: Any, response: Any, time: float) -> None:
        transport = request.transport
        if request.path in UNLOGGED_PATHS or transport is None or transport.is_closing():
            return
        super().log(request, response, time)


class OpenAIApi:
    def __init__(self, dispatcher: Dispatcher, served_model: str | Sequence[str], queue_size: int,
                 serving: Callable[[], bool], registry: CollectorRegistry | None = None,
                 bounds: HttpBounds | None = None, max_body_bytes: int = 8 << 20,
                 max_body_values: int = 1 << 16, keys: Collection[str] = ()) -> None:
        """served_model: the ids it answers to, the main one first; serving: whether the group
        serves (attached and not draining), what /health says; registry: the master's metrics, also
        served here (where the endpoint picker scrapes); max_body_bytes, max_body_values: the
        largest request body read and the most JSON values parsed in it (admission's bounds, see
        Admission.max_body_bytes); keys: the API keys (api_keys; none: open)."""
        self.names = (served_model,) if isinstance(served_model, str) else tuple(served_model)
        self.dispatcher, self.model, self.queue_size = dispatcher, self.names[0], queue_size
        self.serving, self.registry, self.keys = serving, registry, frozenset(keys)
        self.bounds = bounds or HttpBounds()
        self._parser = ThreadPoolExecutor(1, thread_name_prefix="lopa-http-body")
        self.max_body_bytes, self.max_body_values = max_body_bytes, max_body_values
        self.tokens = TokenEndpoints(dispatcher.admission, self.names, self.bounds.body_timeout_s,
                                     max_body_values)

    def app(self, middlewares: Sequence[Any] = ()) -> web.Application:
        keys = [key_middleware(self.keys)] if self.keys else []
        app = web.Application(client_max_size=self.max_body_bytes,
                              middlewares=[*middlewares, openai_errors, *keys])
        app.on_response_prepare.append(no_server_version)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model_entry)
        app.router.add_post("/tokenize", self.tokens.tokenize)
        app.router.add_post("/detokenize", self.tokens.detokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ping", self.health)
        app.router.add_post("/ping", self.health)
        app.router.add_get("/live", self.live)
        app.router.add_get("/version", self.version)
        if self.registry is not None:
            app.router.add_get("/metrics", self.metrics)
        return app

    # -- endpoints ----------------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._entry(name) for name in self.names]})

    async def model_entry(self, request: web.Request) -> web.Response:
        """OpenAI's retrieve-model call (the SDKs' models.retrieve)."""
        asked = request.match_info["model"]
        if asked not in self.names:
            return not_found(UnknownModel(asked, self.names))
        return web.json_response(self._entry(asked))

    def _entry(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "lopa", "root": self.model,
                "max_model_len": self.dispatcher.admission.max_length}

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    async def health(self, request: web.Request) -> web.Response:
        ready = self.serving()
        status = {"status": "SERVING" if ready else "NOT_SERVING"}
        headers = {} if ready else {"Retry-After": str(HEALTH_RETRY_AFTER_S)}
        return web.json_response(status, status=200 if ready else 503, headers=headers)

    async def metrics(self, request: web.Request) -> web.Response:
        """The master's Prometheus metrics, as its metrics port serves them."""
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def live(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "alive"})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    # -- the shared path ----------------------------------------------------------------------------

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        arrived = time.perf_counter()  # latencies start here, before the body is read (as vLLM's)
        read = await self._read(request, chat)
        if isinstance(read, web.Response):
            self.dispatcher.refused("invalid")
            return read
        parsed, body = read
        try:  # all of a batch valid before any is queued, then all queued or none: counts its refusals
            tickets = await self.dispatcher.open(parsed.asks, parsed.stream, arrived=arrived)
        except (InvalidParameter, QueueFull, GroupUnavailable) as error:
            index = error.index if isinstance(error, InvalidInBatch) and parsed.batch else None
            return self._refused(error, chat, body, index)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        echoes = self._echoes(parsed, tickets)
        if parsed.stream:
            tokenizer = self.dispatcher.admission.tokenizer
            return await stream(request, tickets, parsed, ident, chat, echoes, tokenizer)
        # A client that disconnects cancels the handler, and with it every ticket's wait (each then
        # counted as cancelled); otherwise each is counted by its own outcome.
        done = await asyncio.gather(*(ticket.finished() for ticket in tickets), return_exceptions=True)
        failed = next((outcome for outcome in done if isinstance(outcome, BaseException)), None)
        if failed is not None:
            return failure(failed)
        return web.json_response(self._response([f.completion for f in done], parsed, ident, chat, echoes))

    def _echoes(self, parsed: Parsed, tickets: Sequence[Any]) -> list[str]:
        """completions' echo: each choice's prompt as text (a text prompt as sent, token ids decoded)."""
        if not parsed.echo:
            return [""] * len(tickets)
        tokenizer = self.dispatcher.admission.tokenizer
        return [ask.prompt if isinstance(ask.prompt, str) else tokenizer.decode(ticket.request.prompt_ids)
                for ask, ticket in zip(parsed.asks, tickets, strict=True)]

    async def _read(self, request: web.Request, chat: bool) -> tuple[Parsed, Any] | web.Response:
        """The body's requests and its JSON, or the response that refuses it."""
        unread = self._refuse_unread(request)
        if unread is not None:
            return unread
        try:
            raw = await asyncio.wait_for(request.read(), self.bounds.body_timeout_s)
            args = (raw, request.charset, chat, self.names, self.queue_size, self.max_body_values)
            if len(raw) < INLINE_BODY_BYTES:
                return parse_body(*args)
            # A large body is parsed off the event loop: /health and every other request go on. One
            # thread parses them in turn: several at once would each take the GIL from the loop.
            return await asyncio.get_running_loop().run_in_executor(self._parser, parse_body, *args)
        except web.HTTPRequestEntityTooLarge:
            return self._too_large()
        except asyncio.TimeoutError:
            return error_response(408, f"body: not received within {self.bounds.body_timeout_s:g} s",
                                  "invalid_request_error", "body")
        except bounded_json.TooManyValues as error:
            return error_response(413, f"body: {error}, more than a request of this server's limits holds",
                                  "invalid_request_error", "body")
        except UnknownModel as error:
            return not_found(error)
        except InvalidParameter as error:  # named as in the body already
            return invalid(error.field, error.reason)
        except (ValueError, LookupError, RecursionError) as error:  # UnicodeDecodeError, NotJson
            return invalid("body", bounded_json.unreadable(error))

    def _refuse_unread(self, request: web.Request) -> web.Response | None:
        """What the headers alone refuse, before a byte of the body is read: a compressed body (never
        inflated: a small one can inflate to gigabytes) and a declared length over the limit."""
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            return error_response(415, f"body: Content-Encoding {encoding!r} is not accepted; send the body "
                                       "uncompressed", "invalid_request_error", "body")
        declared = request.headers.get("Content-Type")
        if declared is not None and not _json_type(request.content_type):
            return error_response(415, f"body: Content-Type {request.content_type!r} is not accepted; send "
                                       "JSON (application/json)", "invalid_request_error", "body")
        if (request.content_length or 0) > self.max_body_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> web.Response:
        return error_response(413, f"body: larger than {self.max_body_bytes} bytes, the most a request of "
                                   "this server's limits needs", "invalid_request_error", "body")

    def _refused(self, error: Exception, chat: bool, body: Any, index: int | None) -> web.Response:
        """A request the pipeline would not queue; `index`: which prompt of a batch."""
        if isinstance(error, InvalidParameter):  # admission names the server's field
            param = body_field(error.field, chat, body)
            reason = NO_TEMPLATE_HINT if error.reason == NO_CHAT_TEMPLATE else error.reason
            if index is None:
                return invalid(param, reason)
            if param == "prompt":
                return invalid(f"prompt[{index}]", reason)
            return invalid(param, f"{reason} (prompt[{index}])")
        return failure(error)

    def _response(self, done: list[Completion], parsed: Parsed, ident: str, chat: bool, echoes: list[str]
                  ) -> dict[str, Any]:
        choices = []
        for index, c in enumerate(done):
            choice: dict[str, Any] = {"index": index, "finish_reason": FINISH[c.finish_reason],
                                      "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = echoes[index] + c.text
            if parsed.logprobs:
                choice["logprobs"] = token_logprobs(self.dispatcher.admission.tokenizer, c, chat,
                                                    parsed.top_logprobs)
            if parsed.batch:  # each prompt's own decoding stats
                choice["lopa"] = lopa_stats(c)
            choices.append(choice)
        reply = {"id": ident, "object": "chat.completion" if chat else "text_completion",
                 "created": int(time.time()), "model": parsed.model, "choices": choices,
                 "usage": total_usage(done)}
        return reply if parsed.batch else {**reply, "lopa": lopa_stats(done[0])}

async def start_http(api: OpenAIApi, host: str, port: int, tls: TlsConfig,
                     count_refused: Callable[[str], None] = lambda reason: None,
                     access_log: bool = True) -> web.AppRunner:
    """Serve the API on host:port, its connections bounded (connection_guard, http_site; count_refused:
    called with the reason of each connection refused or evicted); handler_cancellation: a
    disconnect cancels the handler, which cancels the request (see OpenAIApi._serve). access_log: a
    line per request on the lopa.access logger (ACCESS_LOG_FORMAT: no body, so no prompt)."""
    guard = ConnectionGuard(api.bounds, asyncio.get_running_loop(), count_refused)
    # auto_decompress off: a compressed body is refused unread, never inflated (_refuse_unread)
    handler_args = {"keepalive_timeout": api.bounds.keepalive_timeout_s, "auto_decompress": False,
                    "access_log": logging.getLogger("lopa.access") if access_log else None,
                    "access_log_class": AnsweredAccessLog, "access_log_format": ACCESS_LOG_FORMAT}
    runner = web.AppRunner(api.app([guard_middleware(guard)]), handler_cancellation=True,
                           shutdown_timeout=SHUTDOWN_S, **handler_args)
    await runner.setup()
    try:
        await BoundedSite(runner, host, port, guard, handler_args, ssl_context(tls)).start()
    except OSError as error:
        await runner.cleanup()
        taken = PortTaken if error.errno == errno.EADDRINUSE else OSError
        raise taken(f"master.http_port: cannot listen on port {port}: {error.strerror or error}") from None
    return runner
