"""The cluster DNS of the process node: the A records CoreDNS would serve for cluster.local.

A small UDP DNS server on the pod network's gateway address, port 53, named in every pod's
/etc/resolv.conf (`pod_sandbox`). So the pods' own resolvers (glibc, gRPC's c-ares) apply the
search list and ndots:5 exactly as in a cluster, and `<pod>.<svc>.<ns>.svc` resolves through
`<pod>.<svc>.<ns>.svc.cluster.local`. Records, from Services and EndpointSlices (`services`):
- `<svc>.<ns>.svc.cluster.local`: a Service's virtual IP (`service_proxy`); for a headless Service
  the addresses of its ready endpoints (all of them with publishNotReadyAddresses, which makes the
  EndpointSlice controller publish them as ready);
- `<hostname>.<svc>.<ns>.svc.cluster.local`: an endpoint of a headless Service that has a hostname
  (a StatefulSet pod whose subdomain is that Service).

Where it differs from CoreDNS: A records only (AAAA and other types get an empty answer; no SRV,
no pod-IP names like 10-244-0-5.<ns>.pod, no ExternalName CNAMEs); a Service's name resolves to the
virtual IP of `service_proxy`, not to spec.clusterIP (two test clusters on one machine may hand out
the same ClusterIP); names outside cluster.local get NXDOMAIN (pods have no outside world); UDP only.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable

from .services import ServiceView

A, IN = 1, 1
NOERROR, NXDOMAIN, FORMERR = 0, 3, 1
TTL = 5  # seconds: short, so a recreated pod's new address is seen at once
ZONE = ".svc.cluster.local"

Lookup = Callable[[str], "list[str] | None"]  # name -> addresses ([]: exists, no A record; None: no name)


def parse_question(packet: bytes) -> tuple[int, int, str, int, int]:
    """(id, flags, name, qtype, end of the question) of a query; ValueError when malformed."""
    if len(packet) < 12:
        raise ValueError("short header")
    ident, flags, qdcount = struct.unpack(">HHH", packet[:6])
    if qdcount < 1:
        raise ValueError("no question")
    labels: list[str] = []
    pos = 12
    while True:
        length = packet[pos]
        pos += 1
        if length == 0:
            break
        if length & 0xC0:
            raise ValueError("compressed name in a question")
        labels.append(packet[pos : pos + length].decode("ascii", "replace"))
        pos += length
    qtype, _ = struct.unpack(">HH", packet[pos : pos + 4])
    return ident, flags, ".".join(labels).lower(), qtype, pos + 4


def answer(packet: bytes, lookup: Lookup) -> bytes:
    try:
        ident, flags, name, qtype, end = parse_question(packet)
    except (ValueError, IndexError, struct.error):
        return packet[:2] + struct.pack(">HHHHH", 0x8000 | FORMERR, 0, 0, 0, 0) if len(packet) >= 2 else b""
    addresses = lookup(name) if name.endswith(ZONE) else None
    rcode = NXDOMAIN if addresses is None else NOERROR
    records = list(addresses or []) if qtype == A else []
    # QR, AA, RA; the opcode and RD of the query are echoed.
    reply_flags = 0x8000 | (flags & 0x7900) | 0x0400 | 0x0080 | rcode
    out = bytearray(struct.pack(">HHHHHH", ident, reply_flags, 1, len(records), 0, 0))
    out += packet[12:end]
    for address in records:
        out += b"\xc0\x0c" + struct.pack(">HHIH", A, IN, TTL, 4) + socket.inet_aton(address)
    return bytes(out)


class ClusterDNS:
    """Serves `lookup` on `address`:53/udp from a thread until `close()`."""

    def __init__(self, address: str, lookup: Lookup, port: int = 53) -> None:
        self.address = address
        self._lookup = lookup
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((address, port))
        self._sock.settimeout(0.5)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="cluster-dns", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                packet, peer = self._sock.recvfrom(1500)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                reply = answer(packet, self._lookup)
            except Exception:  # a lookup that failed (API server hiccup): let the client retry
                continue
            with contextlib.suppress(OSError):
                self._sock.sendto(reply, peer)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()


def records(
    views: dict[tuple[str, str], ServiceView], vip: Callable[[str, str], str | None]
) -> dict[str, list[str]]:
    """name -> addresses, for every Service view."""
    out: dict[str, list[str]] = {}
    for view in views.values():
        base = f"{view.name}.{view.namespace}{ZONE}"
        if not view.headless:
            address = vip(view.namespace, view.name)
            out[base] = [address] if address else []
            continue
        ready = view.ready()
        out[base] = sorted({e.address for e in ready})
        for endpoint in ready:
            if endpoint.hostname:
                out.setdefault(f"{endpoint.hostname}.{base}", []).append(endpoint.address)
    return out
