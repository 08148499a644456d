"""The collective's rendezvous through an authenticated store.

torch.distributed forms a group through a key-value store; its own TCPStore answers anyone who
reaches its port, on every interface. Here rank 0 serves the store over gRPC (the Rendezvous
service of worker.proto) on workers.rendezvous, with the worker API's security (the group secret,
mutual TLS when configured: lopa.serving.shared.group_link), and every rank, rank 0 included,
joins through `GroupStore`, a torch Store whose operations are calls to it. A stranger's set or
get is refused (UNAUTHENTICATED); the store lives as long as rank 0's process.
"""

from __future__ import annotations

import ipaddress
import threading
from concurrent import futures
from datetime import timedelta
from typing import Any

import grpc
import torch.distributed as dist

from lopa.proto import worker_pb2, worker_pb2_grpc
from lopa.serving.shared.config import split_address
from lopa.serving.shared.group_link import LinkSecurity
from lopa.serving.shared.listen import NO_REUSEPORT, add_port

Op = worker_pb2.StoreRequest
_RPC_SLACK_S = 5.0  # a call's deadline beyond the store's own wait


class StoreService(worker_pb2_grpc.RendezvousServicer):
    """The keys of one group, in memory; waits are bounded by the caller's timeout."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()

    def Store(self, request: worker_pb2.StoreRequest, context: grpc.ServicerContext) -> worker_pb2.StoreReply:
        keys, op = list(request.keys), request.op
        with self._changed:
            if op == Op.SET:
                self._data[keys[0]] = request.value
                self._changed.notify_all()
                return worker_pb2.StoreReply()
            if op in (Op.GET, Op.WAIT):
                if not self._changed.wait_for(lambda: all(k in self._data for k in keys), request.timeout_s):
                    missing = [k for k in keys if k not in self._data]
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"keys {missing} not set within "
                                                                     f"{request.timeout_s:g} s")
                return worker_pb2.StoreReply(value=self._data[keys[0]] if op == Op.GET else b"")
            if op == Op.ADD:
                number = int(self._data.get(keys[0], b"0")) + request.amount
                self._data[keys[0]] = str(number).encode()
                self._changed.notify_all()
                return worker_pb2.StoreReply(number=number)
            if op == Op.COMPARE_SET:
                current = self._data.get(keys[0])
                if (current is None and not request.expected) or current == request.expected:
                    self._data[keys[0]] = current = request.value
                    self._changed.notify_all()
                return worker_pb2.StoreReply(value=current if current is not None else request.expected)
            if op == Op.CHECK:
                return worker_pb2.StoreReply(ok=all(k in self._data for k in keys))
            if op == Op.DELETE:
                return worker_pb2.StoreReply(ok=self._data.pop(keys[0], None) is not None)
            return worker_pb2.StoreReply(number=len(self._data))  # NUM_KEYS


def serve_store(address: str, security: LinkSecurity) -> grpc.Server:
    """Rank 0's store on `address` (OSError naming workers.rendezvous when it cannot bind)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32), options=[NO_REUSEPORT],
                         interceptors=security.interceptors())
    worker_pb2_grpc.add_RendezvousServicer_to_server(StoreService(), server)
    add_port(server, address, "workers.rendezvous", security.server_credentials())
    server.start()
    return server


def bind_address(rendezvous: str) -> str:
    """Where rank 0 serves the store: a literal IP as given (loopback under `lopa serve`: nothing
    beyond the host reaches it), a DNS name (a pod's) on every interface."""
    host, port = split_address(rendezvous)
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return f"0.0.0.0:{port}"
    return rendezvous


class GroupStore(dist.Store):
    """A torch.distributed Store whose every operation is a call to rank 0's StoreService."""

    def __init__(self, address: str, security: LinkSecurity, timeout: timedelta) -> None:
        super().__init__()
        self._channel = security.channel(address, [("grpc.initial_reconnect_backoff_ms", 100),
                                                   ("grpc.max_reconnect_backoff_ms", 1000)])
        self._stub = worker_pb2_grpc.RendezvousStub(self._channel)
        self._timeout = timeout

    def _call(self, wait_s: float = 0.0, **request: Any) -> worker_pb2.StoreReply:
        # wait_for_ready: rank 0's store may start after this rank (peers come up in any order).
        deadline = wait_s + _RPC_SLACK_S if wait_s else self._timeout.total_seconds()
        try:
            return self._stub.Store(worker_pb2.StoreRequest(timeout_s=wait_s, **request), timeout=deadline,
                                    wait_for_ready=True)
        except grpc.RpcError as error:
            raise RuntimeError(f"rendezvous store: {error.code().name}: {error.details()}") from None

    def set(self, key: str, value: Any) -> None:
        self._call(op=Op.SET, keys=[key], value=_bytes(value))

    def get(self, key: str) -> bytes:
        return self._call(self._timeout.total_seconds(), op=Op.GET, keys=[key]).value

    def add(self, key: str, amount: int) -> int:
        return self._call(op=Op.ADD, keys=[key], amount=amount).number

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        reply = self._call(op=Op.COMPARE_SET, keys=[key], expected=_bytes(expected), value=_bytes(desired))
        return reply.value

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._call((timeout or self._timeout).total_seconds(), op=Op.WAIT, keys=list(keys))

    def check(self, keys: list[str]) -> bool:
        return self._call(op=Op.CHECK, keys=list(keys)).ok

    def delete_key(self, key: str) -> bool:
        return self._call(op=Op.DELETE, keys=[key]).ok

    def num_keys(self) -> int:
        return self._call(op=Op.NUM_KEYS).number

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def close(self) -> None:
        self._channel.close()


def _bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
