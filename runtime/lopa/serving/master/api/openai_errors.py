"""The OpenAI API's error answers: OpenAI's shape {"error": {"message", "type", "param", "code"}}.

A request's failure is answered as its row of lopa.serving.master.failures says (400 naming the
body field, 429, 503, 504, 499, 500; Retry-After where the row has one), with its message.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from lopa.serving.master.failures import failure_of


def error_response(
    status: int, message: str, kind: str, param: str | None = None, code: str | None = None
) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status)


def invalid(param: str, reason: str) -> web.Response:
    return error_response(400, f"{param}: {reason}", "invalid_request_error", param)


def failure(error: BaseException, param: str | None = None, message: str | None = None) -> web.Response:
    """A request that failed, as its row of the failure table; `param` and `message` replace an
    invalid field's server name and the message with the body's names."""
    found = failure_of(error)
    kind = found.kind
    response = error_response(kind.http_status, message or found.message, kind.openai_type,
                              param or found.field)
    if found.retry_after_s is not None:
        response.headers["Retry-After"] = str(found.retry_after_s)
    return response


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
