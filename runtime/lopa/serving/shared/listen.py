"""Binding the master's and the workers' gRPC ports: exclusively, with errors naming the config key."""

from __future__ import annotations

from typing import Any

import grpc

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
        raise OSError(f"{key}: cannot listen on {address}: already in use or not an address")
    return port
