"""Free ports for a local group: picked out of the way of outgoing connections, or from LOPA_PORT_RANGE."""

from __future__ import annotations

import collections
import os
import random
import socket
import threading
from pathlib import Path

from lopa.params import InvalidParameter

# The ports free_ports picks from, "LOW-HIGH" (inclusive): for a host whose firewall opens only some,
# or for processes side by side on one host that must never pick the same port.
PORT_RANGE_ENV = "LOPA_PORT_RANGE"

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_BELOW_EPHEMERAL = 8192  # ports tried below the ephemeral range
# Ports this process handed out lately: free until their server binds them, so not handed out again
# meanwhile (two calls, e.g. a metrics port and then a group's ports, must not collide).
_handed_out: collections.deque[int] = collections.deque(maxlen=512)
_handed_out_lock = threading.Lock()


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """Distinct free ports on `host` (held open together so none is handed out twice): from
    LOPA_PORT_RANGE when set, else below the kernel's ephemeral range where it leaves room. A port the
    kernel hands out (bind to port 0) lies in that range, where any outgoing connection (a worker's to
    the master, say) may take it as its local port before its server listens."""
    pool, confined = port_pool()
    sockets: list[socket.socket] = []
    try:
        with _handed_out_lock:
            recent = set(_handed_out)
        candidates = [p for p in pool if p not in recent]
        random.shuffle(candidates)
        for port in candidates:
            if len(sockets) == n:
                break
            s = socket.socket()
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            sockets.append(s)
        if len(sockets) < n and confined:
            where = f"{pool.start}-{pool.stop - 1}"
            raise InvalidParameter(PORT_RANGE_ENV, f"{n} free ports needed, {len(sockets)} left in {where}")
        while len(sockets) < n:  # no room below the range: let the kernel choose
            s = socket.socket()
            sockets.append(s)
            s.bind((host, 0))
        ports = [s.getsockname()[1] for s in sockets]
        with _handed_out_lock:
            _handed_out.extend(ports)
        return ports
    finally:
        for s in sockets:
            s.close()


def port_pool() -> tuple[range, bool]:
    """The ports to pick from and whether they are all there is (LOPA_PORT_RANGE set)."""
    spec = os.environ.get(PORT_RANGE_ENV, "").strip()
    if not spec:
        low = _ephemeral_low()
        return range(max(1024, low - _BELOW_EPHEMERAL), low), False
    first, dash, last = spec.partition("-")
    try:
        low, high = int(first), int(last)
    except ValueError:
        low = high = 0
    if not dash or not 1 <= low <= high <= 65535:
        bounds = "must be LOW-HIGH with 1 <= LOW <= HIGH <= 65535"
        raise InvalidParameter(PORT_RANGE_ENV, f"{bounds}, got {spec!r}")
    return range(low, high + 1), True


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 when unreadable)."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
