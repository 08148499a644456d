"""The OpenAI API's error answers: OpenAI's shape {"error": {"message", "type", "param", "code"}}.

400 naming the body field, 429 when the queue is full, 503 when the worker group is lost or not
formed (with Retry-After), 504 when the request's deadline passed, 500 otherwise. A failure's
message is the dispatcher's client_reason: never an internal address.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from lopa.params import InvalidParameter
from lopa.scheduling.request import RequestAborted
from lopa.serving.master.dispatch import client_reason, outcome_label, retry_after_s


def error_response(
    status: int, message: str, kind: str, param: str | None = None, code: str | None = None
) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status)


def invalid(param: str, reason: str) -> web.Response:
    return error_response(400, f"{param}: {reason}", "invalid_request_error", param)


def unavailable(message: str, retry_after: int) -> web.Response:
    """503, with when to retry (a lost group re-forms in seconds)."""
    response = error_response(503, message, "service_unavailable")
    response.headers["Retry-After"] = str(retry_after)
    return response


def failure(error: BaseException) -> web.Response:
    """A request that was queued and did not complete (the message: client_reason's)."""
    if isinstance(error, RequestAborted):
        if error.deadline:
            return error_response(504, str(error), "timeout")
        return error_response(499, str(error), "cancelled")
    if isinstance(error, InvalidParameter):
        return error_response(400, str(error), "invalid_request_error", error.field)
    if outcome_label(error) == "unavailable":
        return unavailable(client_reason(error), retry_after_s(error))
    return error_response(500, client_reason(error), "server_error")


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
