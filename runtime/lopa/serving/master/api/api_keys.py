"""Bearer API keys on the HTTP API, as vLLM's --api-key: without one of the keys a request to the
API's paths gets 401 in OpenAI's error shape; the probes and the metrics stay open. The keys and
their check: lopa.serving.master.keys (the gRPC API takes the same ones).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection

from aiohttp import web

from lopa.serving.master.api.openai_errors import error_response
from lopa.serving.master.keys import authorized

# Open whatever the keys: the load balancer's and the orchestrator's probes, the scrapes.
OPEN_PATHS = frozenset({"/health", "/live", "/ping", "/version", "/metrics"})


def key_middleware(keys: Collection[str]) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def middleware(request: web.Request, handler: Callable[..., Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        if request.path in OPEN_PATHS or authorized(request.headers.get("Authorization", ""), keys):
            return await handler(request)
        response = error_response(401, "a valid API key is required: send the header "
                                       "'Authorization: Bearer <key>'", "invalid_request_error",
                                  code="invalid_api_key")
        response.headers["WWW-Authenticate"] = "Bearer"
        return response

    return middleware
