"""kube-proxy for the process node, in userspace: a Service's port forwards to a ready endpoint.

Every non-headless Service of the served namespaces gets a virtual IP on the pod network's bridge
(`netns.PodNetwork.add_vip`; `cluster_dns` resolves the Service's name to it) and one TCP listener
per port. A connection is forwarded, bytes both ways, to the next ready endpoint (round robin) on
the port the EndpointSlice resolved for the Service port's targetPort (a named port included).

Where it differs from kube-proxy: the virtual IP is not spec.clusterIP (see `cluster_dns`), TCP
only, no session affinity, NodePort or LoadBalancer paths; with no ready endpoint a connection is
accepted and closed at once (kube-proxy rejects it), which a client sees as unavailable either way.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
from collections.abc import Callable

from .services import Endpoint, ServiceView

CONNECT_TIMEOUT = 5.0


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class _Listener:
    def __init__(
        self, address: str, port: int, port_name: str, endpoints: Callable[[], list[Endpoint]]
    ) -> None:
        self.port_name = port_name
        self.endpoints = endpoints
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((address, port))
        self.sock.listen(64)
        self.sock.settimeout(0.5)
        self._turn = itertools.count()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, name=f"proxy-{address}:{port}", daemon=True)
        self.thread.start()

    def _target(self) -> tuple[str, int] | None:
        ready = [(e.address, e.port(self.port_name)) for e in self.endpoints()]
        ready = [(a, p) for a, p in ready if p]
        if not ready:
            return None
        address, port = ready[next(self._turn) % len(ready)]
        assert port is not None
        return address, port

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._forward, args=(client,), daemon=True).start()

    def _forward(self, client: socket.socket) -> None:
        target = self._target()
        try:
            if target is None:
                raise OSError("no ready endpoint")
            upstream = socket.create_connection(target, timeout=CONNECT_TIMEOUT)
            upstream.settimeout(None)
        except OSError:
            client.close()
            return
        client.settimeout(None)
        threading.Thread(target=_pump, args=(upstream, client), daemon=True).start()
        _pump(client, upstream)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)
        self.sock.close()


class ServiceProxy:
    """`sync()` with the current Service views opens listeners for new Services; `vip()` names
    a Service's virtual IP; `close()` stops every listener."""

    def __init__(self, add_vip: Callable[[], str]) -> None:
        self._add_vip = add_vip
        self._vips: dict[tuple[str, str], str] = {}
        self._views: dict[tuple[str, str], ServiceView] = {}
        self._listeners: dict[tuple[str, str, int], _Listener] = {}
        self._lock = threading.Lock()

    def vip(self, namespace: str, name: str) -> str | None:
        with self._lock:
            return self._vips.get((namespace, name))

    def sync(self, views: dict[tuple[str, str], ServiceView]) -> None:
        with self._lock:
            self._views = dict(views)
        for key, view in views.items():
            if view.headless:
                continue
            with self._lock:
                if key not in self._vips:
                    self._vips[key] = self._add_vip()
                address = self._vips[key]
            for port in view.ports:
                if port.get("protocol", "TCP") != "TCP" or (*key, int(port["port"])) in self._listeners:
                    continue
                self._listeners[(*key, int(port["port"]))] = _Listener(
                    address, int(port["port"]), port.get("name", ""), lambda k=key: self._ready(k)
                )

    def _ready(self, key: tuple[str, str]) -> list[Endpoint]:
        with self._lock:
            view = self._views.get(key)
        return view.ready() if view else []

    def close(self) -> None:
        for listener in self._listeners.values():
            listener.close()
        self._listeners.clear()
