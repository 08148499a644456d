"""Optional TLS for the client API: server cert/key, and a client CA to require client certificates."""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc

from lopa.serving.shared.config import ConfigError, TlsConfig


def _read(path: str, key: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ConfigError(f"tls.{key}: cannot read {path}: {error.strerror}") from None


def ssl_context(tls: TlsConfig) -> ssl.SSLContext | None:
    """The server certificate as an ssl context (the HTTP API's HTTPS; client certificates required
    when client_ca is set), None without TLS. ConfigError naming the key when a file does not parse:
    gRPC takes any bytes, then fails to bind with a message about the address."""
    if not tls.enabled:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(tls.cert, tls.key)
    except ssl.SSLError as error:
        reason = f"not a PEM certificate and its private key ({error.reason})"
        raise ConfigError(f"tls.cert / tls.key: {reason}") from None
    if tls.client_ca:
        try:
            context.load_verify_locations(tls.client_ca)
        except ssl.SSLError as error:
            raise ConfigError(f"tls.client_ca: not a PEM CA certificate ({error.reason})") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials | None:
    if not tls.enabled:
        return None
    pair = [(_read(tls.key, "key"), _read(tls.cert, "cert"))]
    client_ca = _read(tls.client_ca, "client_ca") if tls.client_ca else None
    ssl_context(tls)  # the files parse (named errors), before gRPC takes their bytes
    if client_ca is not None:
        return grpc.ssl_server_credentials(pair, client_ca, require_client_auth=True)
    return grpc.ssl_server_credentials(pair)


def channel_credentials(
    ca: str | None = None, cert: str | None = None, key: str | None = None
) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=Path(ca).read_bytes() if ca else None,
        private_key=Path(key).read_bytes() if key else None,
        certificate_chain=Path(cert).read_bytes() if cert else None,
    )
