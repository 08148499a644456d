"""The master's OpenAI-compatible HTTP API (aiohttp, on the master's own asyncio loop).

    POST /v1/completions        POST /v1/chat/completions   (stream: true -> server-sent events)
    GET  /v1/models, /v1/models/{id}    GET /health (200 once the group serves, else 503)   GET /live
    GET  /metrics (the master's Prometheus metrics: where the inference gateway scrapes)

Why aiohttp: it runs on the event loop grpc.aio already drives in the master, so an HTTP request
enters the very same Dispatcher.open as a gRPC one (one queue, one validation, one set of
limits and metrics), with no second server thread; it is already in the stack (kopf) and streams
server-sent events with a plain StreamResponse.

Errors use OpenAI's shape {"error": {"message", "type", "param", "code"}}: 400 naming the body
field, 429 when the queue is full, 503 when the worker group is lost or not formed, 504 when the
request's deadline passed, 500 otherwise. A client that disconnects cancels its request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from lopa.model.tokenizer import NO_CHAT_TEMPLATE
from lopa.params import InvalidParameter
from lopa.scheduling.request import Completion, QueueFull, RequestAborted
from lopa.serving.master.admission import InvalidInBatch
from lopa.serving.master.api.http_site import (
    BoundedSite,
    ConnectionGuard,
    HttpBounds,
    guard_middleware,
    no_server_version,
)
from lopa.serving.master.api.openai_body import Parsed, body_field, chat_request, completion_request
from lopa.serving.master.dispatch import Dispatcher, GroupUnavailable, Ticket, outcome_label
from lopa.serving.master.events import Finished, Progress
from lopa.serving.shared.config import TlsConfig
from lopa.serving.shared.tls import ssl_context

log = logging.getLogger("lopa.master")
RETRY_AFTER_S = 1  # a full queue drains in about a request's time: retry soon, not at once
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
NO_TEMPLATE_HINT = "the model has no chat template; send a plain prompt to /v1/completions"


def error_response(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return web.json_response(body, status=status)


def invalid(param: str, reason: str) -> web.Response:
    return error_response(400, f"{param}: {reason}", "invalid_request_error", param)


def _unreadable(error: Exception) -> str:
    """Why a body could not be read as JSON, for its 400."""
    if isinstance(error, LookupError):
        return "unknown charset in the Content-Type header"
    if isinstance(error, RecursionError):
        return "nested too deeply"
    return "not valid JSON"


def failure(error: BaseException) -> web.Response:
    """A request that was queued and did not complete."""
    if isinstance(error, RequestAborted):
        if error.deadline:
            return error_response(504, str(error), "timeout")
        return error_response(499, str(error), "cancelled")
    if isinstance(error, InvalidParameter):
        return error_response(400, str(error), "invalid_request_error", error.field)
    if outcome_label(error) == "unavailable":
        return error_response(503, str(error), "service_unavailable")
    return error_response(500, "internal error (see the master log)", "server_error")


class OpenAIApi:
    def __init__(self, dispatcher: Dispatcher, served_model: str, queue_size: int,
                 serving: Callable[[], bool], registry: CollectorRegistry | None = None,
                 bounds: HttpBounds | None = None, max_body_bytes: int = 8 << 20) -> None:
        """serving: whether the group serves (attached and not draining), what /health says;
        registry: the master's metrics, also served here (where the endpoint picker scrapes);
        max_body_bytes: the largest request body read (admission's bound, see Admission.max_body_bytes)."""
        self.dispatcher, self.model, self.queue_size = dispatcher, served_model, queue_size
        self.serving, self.registry = serving, registry
        self.bounds, self.max_body_bytes = bounds or HttpBounds(), max_body_bytes

    def app(self, middlewares: Sequence[Any] = ()) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[*middlewares, openai_errors])
        app.on_response_prepare.append(no_server_version)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model_entry)
        app.router.add_get("/health", self.health)
        app.router.add_get("/live", self.live)
        if self.registry is not None:
            app.router.add_get("/metrics", self.metrics)
        return app

    # -- endpoints ----------------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._entry()]})

    async def model_entry(self, request: web.Request) -> web.Response:
        """OpenAI's retrieve-model call (the SDKs' models.retrieve)."""
        asked = request.match_info["model"]
        if asked != self.model:
            return error_response(404, f"model {asked!r} not found; this server serves {self.model!r}",
                                  "invalid_request_error", "model")
        return web.json_response(self._entry())

    def _entry(self) -> dict[str, Any]:
        return {"id": self.model, "object": "model", "created": 0, "owned_by": "lopa"}

    async def health(self, request: web.Request) -> web.Response:
        ready = self.serving()
        status = {"status": "SERVING" if ready else "NOT_SERVING"}
        return web.json_response(status, status=200 if ready else 503)

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
        try:
            text = await asyncio.wait_for(request.text(), self.bounds.body_timeout_s)
            # A large body is parsed off the event loop: /health and every other request go on.
            body = json.loads(text) if len(text) < 1 << 16 else await asyncio.to_thread(json.loads, text)
        except web.HTTPRequestEntityTooLarge:
            self.dispatcher.refused("invalid")
            return error_response(413, f"body: larger than {self.max_body_bytes} bytes, the most a request "
                                       "of this server's limits needs", "invalid_request_error", "body")
        except asyncio.TimeoutError:
            self.dispatcher.refused("invalid")
            return error_response(408, f"body: not received within {self.bounds.body_timeout_s:g} s",
                                  "invalid_request_error", "body")
        except (json.JSONDecodeError, UnicodeDecodeError, LookupError, RecursionError) as error:
            self.dispatcher.refused("invalid")
            return invalid("body", _unreadable(error))
        try:
            parsed = chat_request(body, self.model) if chat else completion_request(body, self.model)
        except InvalidParameter as error:  # named as in the body already
            self.dispatcher.refused("invalid")
            return invalid(error.field, error.reason)
        if len(parsed.asks) > self.queue_size:  # could never be queued at once: no retry helps
            self.dispatcher.refused("invalid")
            return invalid("prompt", f"at most {self.queue_size} prompts per request (limits.queue_size), "
                                     f"got {len(parsed.asks)}")
        try:  # all of a batch valid before any is queued, then all queued or none: counts its refusals
            tickets = await self.dispatcher.open(parsed.asks, parsed.stream, arrived=arrived)
        except (InvalidParameter, QueueFull, GroupUnavailable) as error:
            index = error.index if isinstance(error, InvalidInBatch) and parsed.batch else None
            return self._refused(error, chat, body, index)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if parsed.stream:
            return await self._stream(request, tickets, parsed, ident, chat)
        # A client that disconnects cancels the handler, and with it every ticket's wait (each then
        # counted as cancelled); otherwise each is counted by its own outcome.
        done = await asyncio.gather(*(ticket.finished() for ticket in tickets), return_exceptions=True)
        failed = next((outcome for outcome in done if isinstance(outcome, BaseException)), None)
        if failed is not None:
            return failure(failed)
        return web.json_response(self._response([f.completion for f in done], parsed, ident, chat))

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
        if isinstance(error, QueueFull):  # clients back off by Retry-After (seconds)
            response = error_response(429, str(error), "rate_limit_exceeded")
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
            return response
        return error_response(503, str(error), "service_unavailable")

    def _response(self, done: list[Completion], parsed: Parsed, ident: str, chat: bool) -> dict[str, Any]:
        choices = []
        for index, c in enumerate(done):
            choice: dict[str, Any] = {"index": index, "finish_reason": FINISH[c.finish_reason],
                                      "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = c.text
            if parsed.batch:  # each prompt's own decoding stats
                choice["lopa"] = lopa_stats(c)
            choices.append(choice)
        reply = {"id": ident, "object": "chat.completion" if chat else "text_completion",
                 "created": int(time.time()), "model": parsed.model, "choices": choices,
                 "usage": total_usage(done)}
        return reply if parsed.batch else {**reply, "lopa": lopa_stats(done[0])}

    async def _stream(
        self, request: web.Request, tickets: list[Ticket], parsed: Parsed, ident: str, chat: bool
    ) -> web.StreamResponse:
        """Server-sent events of every ticket (a batch's choices interleave, each event naming its
        choice), then [DONE]. A failure after the status line travels as an error event, and the
        batch's other requests stop (counted as cancelled)."""
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        response = web.StreamResponse(headers=headers)
        try:
            await self._stream_events(request, response, tickets, parsed, ident, chat)
        except ConnectionResetError:  # an ordinary event: one line, no traceback
            log.info("HTTP client %s went away during its stream", request.remote)
        finally:
            for ticket in tickets:  # any request whose end was not read stops, counted as cancelled
                ticket.cancel()
        return response

    async def _stream_events(
        self, request: web.Request, response: web.StreamResponse, tickets: list[Ticket], parsed: Parsed,
        ident: str, chat: bool,
    ) -> None:
        await response.prepare(request)
        out = _Chunks(response, ident, parsed.model, chat)
        merged, pumps = _merge(tickets)
        # Every event carries the lookahead branches granted in each round since the one before
        # (rounds that added no text send no event): gRPC's GenerateChunk.granted_branches.
        first, rounds = [True] * len(tickets), [[] for _ in tickets]
        prompts = [len(ticket.admitted.prompt_ids) for ticket in tickets]
        sent = [0] * len(tickets)  # answer tokens streamed so far, per choice
        done: list[Completion] = []
        failed: Exception | None = None
        try:
            while len(done) < len(tickets):
                index, item = await merged.get()
                if isinstance(item, Progress):
                    rounds[index].append(item.granted_branches)
                    sent[index] = item.offset + len(item.token_ids)
                    if item.text or first[index]:
                        extra: dict[str, Any] = {"lopa": {"granted_branches": rounds[index]}}
                        if parsed.continuous_usage:
                            extra["usage"] = usage_of(prompts[index], sent[index])
                        await out.send(index, item.text, extra=extra, first=first[index])
                        if item.text:
                            tickets[index].first_token_sent()
                        first[index], rounds[index] = False, []
                    continue
                if isinstance(item, Exception):
                    failed = item
                    break
                outcome = item.completion
                stats = {"granted_branches": rounds[index], **lopa_stats(outcome)}
                # With include_usage only the last chunk carries usage, as OpenAI's do (clients that
                # add up every chunk's usage would count it twice); the choice's stats stay in lopa.
                own = usage(outcome) if parsed.continuous_usage or not parsed.include_usage else None
                await out.send(index, item.text, FINISH[outcome.finish_reason],
                               {"usage": own, "lopa": stats}, first=first[index])
                done.append(outcome)
        finally:
            for task in pumps:  # a failure or a client gone: the others stop, counted as cancelled
                task.cancel()
        if failed is not None:  # the status line is sent: the error travels as an event, as OpenAI's do
            await response.write(f"data: {failure(failed).text}\n\n".encode())
        elif parsed.include_usage:  # OpenAI's shape: one more chunk, the totals and no choices
            await out.write([], {"usage": total_usage(done)})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()


class _Chunks:
    """The SSE chunks of one streamed response: completion or chat chunk objects, one per event."""

    def __init__(self, response: web.StreamResponse, ident: str, model: str, chat: bool) -> None:
        self.response, self.ident, self.model, self.chat = response, ident, model, chat
        self.created, self.kind = int(time.time()), "chat.completion.chunk" if chat else "text_completion"

    async def write(self, choices: list[dict[str, Any]], extra: dict | None = None) -> None:
        event = {"id": self.ident, "object": self.kind, "created": self.created, "model": self.model,
                 "choices": choices, **(extra or {})}
        await self.response.write(f"data: {json.dumps(event)}\n\n".encode())

    async def send(self, index: int, delta: str, finish: str | None = None, extra: dict | None = None,
                   first: bool = False) -> None:
        if self.chat:
            piece = {"role": "assistant", "content": delta} if first else {"content": delta}
            choice: dict[str, Any] = {"index": index, "delta": piece, "finish_reason": finish}
        else:
            choice = {"index": index, "text": delta, "finish_reason": finish, "logprobs": None}
        await self.write([choice], extra)


def _merge(
    tickets: list[Ticket],
) -> tuple[asyncio.Queue[tuple[int, Progress | Finished | Exception]], list[asyncio.Task]]:
    """Every ticket's events in one queue as they come, (choice index, the event or the error that
    ended it), and the tasks that feed it (cancel them to stop the requests)."""
    merged: asyncio.Queue[tuple[int, Progress | Finished | Exception]] = asyncio.Queue()

    async def pump(index: int, ticket: Ticket) -> None:
        try:
            async for event in ticket.events():
                merged.put_nowait((index, event))
        except Exception as error:
            merged.put_nowait((index, error))

    return merged, [asyncio.create_task(pump(i, ticket)) for i, ticket in enumerate(tickets)]


def usage(c: Completion) -> dict[str, int]:
    return usage_of(len(c.result.prompt_ids), len(c.result.output_ids))


def usage_of(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def total_usage(done: list[Completion]) -> dict[str, int]:
    """The usage of every choice of a reply (one or more completions), summed."""
    each = [usage(c) for c in done]
    return {key: sum(u[key] for u in each) for key in each[0]}


def lopa_stats(c: Completion) -> dict[str, float]:
    r = c.result
    return {"forwards": r.forwards, "tokens": r.tokens, "tpf": round(r.tpf, 4),
            "mean_branches": round(r.mean_branches, 4), "verified_tokens": r.verified_tokens,
            "tokens_per_s": round(r.tokens_per_s, 2),
            "wall_s": round(r.wall_s, 4), "ttft_s": round(c.ttft_s, 4), "queue_s": round(c.queue_s, 4)}


@web.middleware
async def openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own errors (404, 405 ...) in OpenAI's shape."""
    try:
        return await handler(request)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        kind = "invalid_request_error" if error.status < 500 else "server_error"
        return error_response(error.status, f"{request.method} {request.path}: {error.reason}", kind)


async def start_http(api: OpenAIApi, port: int, tls: TlsConfig) -> web.AppRunner:
    """Serve the API on 0.0.0.0:port, its connections bounded (http_site); handler_cancellation: a
    disconnect cancels the handler, which cancels the request (see OpenAIApi._serve)."""
    guard = ConnectionGuard(api.bounds, asyncio.get_running_loop())
    handler_args = {"keepalive_timeout": api.bounds.keepalive_timeout_s, "access_log": None}
    runner = web.AppRunner(api.app([guard_middleware(guard)]), handler_cancellation=True, **handler_args)
    await runner.setup()
    try:
        await BoundedSite(runner, "0.0.0.0", port, guard, handler_args, ssl_context(tls)).start()
    except OSError as error:
        await runner.cleanup()
        raise OSError(f"master.http_port: cannot listen on port {port}: {error.strerror or error}") from None
    return runner
