"""Binding the master's and the workers' ports: exclusively, bounded, with errors naming the config key."""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import grpc

# The exit status of a `lopa master` or `lopa worker` whose port was taken (EADDRINUSE): `lopa serve`,
# which picked its workers' ports free a moment before, picks new ones and starts again.
PORT_TAKEN_EXIT = errno.EADDRINUSE


class PortTaken(OSError):
    """An address that cannot be bound now; the message names its config key."""

# gRPC sets SO_REUSEPORT by default: a second master or worker on a busy port would bind too and
# the kernel would split connections between the two. Off, the second one fails to bind.
NO_REUSEPORT = ("grpc.so_reuseport", 0)


def add_port(server: Any, address: str, key: str, credentials: grpc.ServerCredentials | None = None) -> int:
    """Bind `address` on a grpc or grpc.aio server; returns the bound port.

    Raises OSError naming `key` (the config key of the address) when the address cannot be bound.
    """
    try:
        if credentials is not None:
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:  # grpc 1.5x+ raises "Failed to bind to address"; older versions return 0
        port = 0
    if port == 0:
        raise PortTaken(f"{key}: cannot listen on {address}: already in use or not an address")
    return port


def host_of(address: str) -> str:
    """The host of HOST:PORT, as a socket binds it ("[::]:50051" -> "::")."""
    return address.rpartition(":")[0].strip("[]")


def grpc_server_options(max_connections: int, handshake_s: float, idle_s: float, max_age_s: float,
                        age_grace_s: float, max_message_bytes: int | None = None) -> list[tuple[str, Any]]:
    """A gRPC server's bounds on its connections, in grpc's own channel arguments: at most
    `max_connections` open (more are closed at accept), an HTTP/2 handshake within `handshake_s`, a
    connection without a call closed after `idle_s`, every connection asked to reconnect after
    `max_age_s` (its calls in flight keep `age_grace_s` to end); `max_message_bytes`: the largest
    request read (None: grpc's default, 4 MiB)."""
    options: list[tuple[str, Any]] = [
        NO_REUSEPORT,
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.server_handshake_timeout_ms", _ms(handshake_s)),
        ("grpc.max_connection_idle_ms", _ms(idle_s)),
        ("grpc.max_connection_age_ms", _ms(max_age_s)),
        ("grpc.max_connection_age_grace_ms", _ms(age_grace_s)),
        ("grpc.max_concurrent_streams", STREAMS_PER_CONNECTION),
    ]
    if max_message_bytes is not None:
        options.append(("grpc.max_receive_message_length", max_message_bytes))
    return options


STREAMS_PER_CONNECTION = 256  # calls at once on one connection (a client's further calls wait their turn)


def _ms(seconds: float) -> int:
    return min(int(seconds * 1000), 2**31 - 1)  # grpc reads an int; a week fits
