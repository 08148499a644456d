"""The master-worker link's security: the group secret and mutual TLS, for both ends.

Only a group's master may drive its workers and only its members may join its collective. Every
call of the worker API and of the rendezvous store carries the group secret
(`workers.secret_file`) as a bearer token; a call without it, or with another, is refused with
UNAUTHENTICATED and changes nothing. With `workers.tls_*` the link is mutual TLS as well: a
worker serves its certificate and accepts only clients whose certificate the group's CA signed;
the master checks each worker's certificate for the host name of its address.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from lopa.serving.shared.config import ConfigError, WorkersConfig

METADATA_KEY = "authorization"
UNAUTHENTICATED = "the group secret is missing or wrong (only the group's master and members may call)"


@dataclass(frozen=True)
class LinkSecurity:
    secret: str = ""  # "" = no secret: any client that reaches a worker port may drive it
    cert: bytes = b""  # PEM; all three or none (mutual TLS)
    key: bytes = b""
    ca: bytes = b""

    @property
    def tls(self) -> bool:
        return bool(self.cert)

    @classmethod
    def load(cls, workers: WorkersConfig) -> LinkSecurity:
        """The files the config names, read once at start; ConfigError naming the key at fault."""
        secret = ""
        if workers.secret_file:
            raw = _read("workers.secret_file", workers.secret_file).strip()
            if not raw or not raw.isascii() or any(b < 0x21 or b > 0x7E for b in raw):
                raise ConfigError(f"workers.secret_file: {workers.secret_file} must hold one word of "
                                  "printable ASCII (e.g. 64 hex digits)")
            secret = raw.decode()
        if not workers.tls_cert:
            return cls(secret)
        return cls(secret, _read("workers.tls_cert", workers.tls_cert),
                   _read("workers.tls_key", workers.tls_key), _read("workers.tls_ca", workers.tls_ca))

    # -- the client side: the master's links, every member's rendezvous -----------------------------

    def channel(self, address: str, options: list[tuple[str, Any]]) -> grpc.Channel:
        """A channel to a member's `address` that presents the secret (and the client certificate)."""
        if self.tls:
            credentials = grpc.ssl_channel_credentials(self.ca, self.key, self.cert)
            channel = grpc.secure_channel(address, credentials, options=options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        if self.secret:
            channel = grpc.intercept_channel(channel, _PresentSecret(self.secret))
        return channel

    # -- the server side: a worker's API, rank 0's rendezvous store ----------------------------------

    def interceptors(self) -> list[grpc.ServerInterceptor]:
        return [_CheckSecret(self.secret)] if self.secret else []

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """Mutual TLS: only clients whose certificate the group's CA signed (None: plaintext)."""
        if not self.tls:
            return None
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)


def _read(key: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ConfigError(f"{key}: cannot read {path}: {error.strerror or error}") from None


class _PresentSecret(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor,
                     grpc.UnaryStreamClientInterceptor, grpc.StreamUnaryClientInterceptor):
    """Adds the bearer token to every call's metadata."""

    def __init__(self, secret: str) -> None:
        self.header = (METADATA_KEY, f"Bearer {secret}")

    def _details(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), self.header]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation: Callable, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Callable, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Callable, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Callable, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any


class _CheckSecret(grpc.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call that does not carry the group secret."""

    def __init__(self, secret: str) -> None:
        self.expected = f"Bearer {secret}".encode()

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        presented = dict(details.invocation_metadata or ()).get(METADATA_KEY, "")
        if handler is None or hmac.compare_digest(str(presented).encode(), self.expected):
            return handler
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only refuses."""

    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)
