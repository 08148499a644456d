"""The HTTP port's connection slots: who holds one, and who gives way when a new connection needs one.

A connection is idle (waiting for a request head, or between requests), reading (its head arrived,
its body is still coming) or serving (its request is in the pipeline). At most `max_connections`
are open. A new connection at the limit takes the place of, in this order:

- the oldest connection idle for a second or more;
- the oldest reading one whose body arrives slower than `min_body_rate` bytes/s (averaged since its
  head): a client that trickles a body cannot keep a slot for the whole body timeout;
- the oldest idle one (under a burst of new connections, one accepted a moment ago has not been read
  yet: a probe among them keeps its place while slow bodies are there to give way);
- else it is admitted to a small reserve beyond the limit, for probes only (/health, /live,
  /metrics): a port whose every slot serves a request still answers its health checks. A reserved
  connection serves one probe and is closed; anything else gets a 503.

One client address holds at most `max_per_client` connections: past it, a new one takes the place of
that client's own oldest idle or slow connection, or is refused. A request in progress whose body has
arrived is never cut. Every connection refused or evicted is counted by its reason (the master's
`lopa_http_connections_refused_total`) and summed in one log line per interval.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("lopa.master")
LOG_INTERVAL_S = 10.0
PROBE_RESERVE = 16  # connections beyond the limit, for probes only
PROBE_PATHS = frozenset({"/health", "/live", "/metrics"})
SETTLED_S = 1.0  # idle this long, a connection gives way before a slow body does


@dataclass(frozen=True)
class HttpBounds:
    max_connections: int = 1024
    header_timeout_s: float = 10.0  # a new connection's first request head
    keepalive_timeout_s: float = 75.0  # an idle connection between requests
    body_timeout_s: float = 30.0  # a request body, once its head arrived
    min_body_rate: int = 16384  # bytes/s below which a body being read gives its slot away at the limit
    max_per_client: int = 256  # connections of one client address; 0 = no cap


@dataclass(eq=False)
class Slot:
    connection: Any  # anything with a `transport` (aiohttp's RequestHandler)
    client: str
    reserve: bool = False
    head_at: float = 0.0  # when its current request's head arrived
    idle_at: float = 0.0  # when it last became idle
    body: Any = None  # the body's StreamReader while it is being received
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    def slow(self, now: float, min_rate: int) -> bool:
        return self.body is not None and self.body.total_bytes < min_rate * (now - self.head_at)


class ConnectionGuard:
    def __init__(self, bounds: HttpBounds, loop: asyncio.AbstractEventLoop,
                 count: Callable[[str], None] = lambda reason: None) -> None:
        """count: called with the reason of every connection refused or evicted."""
        self.bounds, self.loop, self._count = bounds, loop, count
        self._slots: dict[Any, Slot] = {}
        self._idle: dict[Any, None] = {}  # the main slots', oldest first
        self._reading: dict[Any, None] = {}  # bodies being received, oldest head first
        self._reserve: dict[Any, None] = {}
        self._clients: dict[str, dict[Any, None]] = collections.defaultdict(dict)
        self._recent: collections.Counter[str] = collections.Counter()
        self._summary: asyncio.TimerHandle | None = None

    @property
    def open(self) -> int:
        """Connections in the main slots (the reserve's not counted)."""
        return len(self._slots) - len(self._reserve)

    def opened(self, connection: Any) -> None:
        slot = Slot(connection, _client_of(connection))
        cap = self.bounds.max_per_client
        own = self._clients.get(slot.client, {})
        if cap and len(own) >= cap:
            victim = self._reclaimable(own)
            if victim is None:
                self._refuse(connection, "client_cap")
                return
            self._evict(victim, "client_cap")
        if self.open >= self.bounds.max_connections:
            if not self._make_room():
                self._refuse(connection, "full")
                return
            slot.reserve = self.open >= self.bounds.max_connections
        self._slots[connection] = slot
        self._clients.setdefault(slot.client, {})[connection] = None
        if slot.reserve:
            self._reserve[connection] = None
        self._wait(slot, self.bounds.header_timeout_s)

    def busy(self, connection: Any, body: Any, path: str) -> bool:
        """A request head arrived (`body`: its StreamReader). False: a reserved connection asked for
        something other than a probe (the caller refuses it)."""
        slot = self._slots.get(connection)
        if slot is None:
            return True
        self._stop_waiting(slot)
        slot.head_at = time.monotonic()
        if not body.is_eof():
            slot.body = body
            self._reading[connection] = None
        if slot.reserve and path not in PROBE_PATHS:
            self._note("not_a_probe")
            return False
        return True

    def reserved(self, connection: Any) -> bool:
        slot = self._slots.get(connection)
        return slot is not None and slot.reserve

    def idle(self, connection: Any) -> None:
        """Its request was answered: it may idle until the keepalive timeout."""
        slot = self._slots.get(connection)
        if slot is None:
            return
        self._reading.pop(connection, None)
        slot.body = None
        if not slot.reserve:
            self._wait(slot, self.bounds.keepalive_timeout_s)

    def closed(self, connection: Any) -> None:
        slot = self._slots.pop(connection, None)
        if slot is None:
            return
        self._stop_waiting(slot)
        self._reading.pop(connection, None)
        self._reserve.pop(connection, None)
        own = self._clients[slot.client]
        own.pop(connection, None)
        if not own:
            del self._clients[slot.client]

    # -- who gives way ------------------------------------------------------------------------------

    def _make_room(self) -> bool:
        """At the limit: evict an idle or slow main-slot connection, else make room in the probe reserve
        (evicting its oldest connection that sent nothing yet). False: no room anywhere."""
        oldest = next(iter(self._idle), None)
        if oldest is not None and time.monotonic() - self._slots[oldest].idle_at >= SETTLED_S:
            self._evict(oldest, "idle")
            return True
        victim = self._slowest_reading()
        if victim is not None:
            self._evict(victim, "slow")
            return True
        if oldest is not None:
            self._evict(oldest, "idle")
            return True
        if len(self._reserve) < PROBE_RESERVE:
            return True
        victim = next((c for c in self._reserve if self._slots[c].head_at == 0.0), None)
        if victim is None:
            return False
        self._evict(victim, "full")
        return True

    def _reclaimable(self, candidates: dict[Any, None]) -> Any:
        now = time.monotonic()
        for connection in candidates:
            if connection in self._idle or self._slots[connection].slow(now, self.bounds.min_body_rate):
                return connection
        return None

    def _slowest_reading(self) -> Any:
        """The oldest main-slot connection whose body is behind the minimum rate (bodies that arrived
        in full leave the reading set on the way)."""
        now, arrived, victim = time.monotonic(), [], None
        for connection in self._reading:  # the oldest is the likeliest behind: usually the first
            slot = self._slots[connection]
            if slot.body.is_eof():
                arrived.append(connection)
            elif not slot.reserve and slot.slow(now, self.bounds.min_body_rate):
                victim = connection
                break
        for connection in arrived:
            del self._reading[connection]
            self._slots[connection].body = None
        return victim

    def _wait(self, slot: Slot, seconds: float) -> None:
        """Idle: closed after `seconds`, and the first to give way at the limit."""
        self._stop_waiting(slot)
        slot.idle_at = time.monotonic()
        if not slot.reserve:
            self._idle[slot.connection] = None
        slot.timer = self.loop.call_later(seconds, self._expire, slot.connection)

    def _stop_waiting(self, slot: Slot) -> None:
        if slot.timer is not None:
            slot.timer.cancel()
            slot.timer = None
        self._idle.pop(slot.connection, None)

    def _expire(self, connection: Any) -> None:
        self.closed(connection)
        _close(connection)

    def _evict(self, connection: Any, reason: str) -> None:
        self._note(reason)
        self._expire(connection)

    def _refuse(self, connection: Any, reason: str) -> None:
        self._note(reason)
        _close(connection)

    def _note(self, reason: str) -> None:
        self._count(reason)
        self._recent[reason] += 1
        if self._summary is None:
            self._summary = self.loop.call_later(LOG_INTERVAL_S, self._log_summary)

    def _log_summary(self) -> None:
        self._summary = None
        counts = ", ".join(f"{reason} {n}" for reason, n in sorted(self._recent.items()))
        self._recent.clear()
        log.warning("HTTP port at its connection limits (master.http_max_connections %d, per client %d) in "
                    "the last %.0f s, connections refused or evicted by reason: %s",
                    self.bounds.max_connections, self.bounds.max_per_client, LOG_INTERVAL_S, counts)


def _client_of(connection: Any) -> str:
    transport = connection.transport
    peer = transport.get_extra_info("peername") if transport is not None else None
    return str(peer[0]) if isinstance(peer, tuple) and peer else ""


def _close(connection: Any) -> None:
    if connection.transport is not None:
        connection.transport.close()
