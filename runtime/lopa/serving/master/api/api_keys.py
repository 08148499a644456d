"""Bearer API keys on the HTTP API, as vLLM's --api-key: without one of the keys a request to the
API's paths gets 401 in OpenAI's error shape; the probes and the metrics stay open.

The keys come from the environment of `lopa master` (LOPA_API_KEY, several separated by commas;
`lopa serve --api-key` sets it for its master), never from a file another process may read, and
they are compared in constant time.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, Collection

from aiohttp import web

from lopa.serving.master.api.openai_errors import error_response
from lopa.serving.shared.config import API_KEY_ENV

# Open whatever the keys: the load balancer's and the orchestrator's probes, the scrapes.
OPEN_PATHS = frozenset({"/health", "/live", "/ping", "/version", "/metrics"})


def api_keys(environ: dict[str, str] | None = None) -> frozenset[str]:
    """The keys of LOPA_API_KEY (empty: the API is open)."""
    raw = (os.environ if environ is None else environ).get(API_KEY_ENV, "")
    return frozenset(key.strip() for key in raw.split(",") if key.strip())


def _authorized(header: str, keys: Collection[str]) -> bool:
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return False
    given = token.strip().encode()
    # Every key compared, each in constant time: the answer's timing tells nothing of the keys.
    return any([hmac.compare_digest(given, key.encode()) for key in keys])  # a list: no short cut


def key_middleware(keys: Collection[str]) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def middleware(request: web.Request, handler: Callable[..., Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        if request.path in OPEN_PATHS or _authorized(request.headers.get("Authorization", ""), keys):
            return await handler(request)
        response = error_response(401, "a valid API key is required: send the header "
                                       "'Authorization: Bearer <key>'", "invalid_request_error",
                                  code="invalid_api_key")
        response.headers["WWW-Authenticate"] = "Bearer"
        return response

    return middleware
