"""Bearer API keys on the gRPC client API, the HTTP API's keys (lopa.serving.master.keys): a call
of lopa.v1.Lopa without `authorization: Bearer <key>` metadata ends UNAUTHENTICATED before its
message is parsed; grpc.health.v1 stays open (the kubelet's and load balancers' probes send no key).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from typing import Any

import grpc

from lopa.serving.master.keys import authorized

OPEN_SERVICES = ("/grpc.health.v1.Health/",)
REFUSAL = "a valid API key is required: send the metadata 'authorization: Bearer <key>'"


class KeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but the open services' without one of `keys`."""

    def __init__(self, keys: Collection[str]) -> None:
        self.keys = frozenset(keys)

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[grpc.RpcMethodHandler]], details: Any
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES):
            return handler
        given = [value for key, value in details.invocation_metadata or () if key == "authorization"]
        if given and authorized(str(given[0]), self.keys):
            return handler
        return refusing(handler)


def refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call UNAUTHENTICATED, reading nothing
    (no deserializer: the request's bytes are never parsed)."""

    async def unary(request: Any, context: Any) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

    async def streaming(request: Any, context: Any) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)
        yield  # an async generator, as a streaming handler is

    serializer = handler.response_serializer
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, None, serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, None, serializer)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, None, serializer)
    return grpc.stream_stream_rpc_method_handler(streaming, None, serializer)
