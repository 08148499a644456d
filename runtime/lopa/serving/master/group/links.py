"""The master's side of the workers: one bidirectional step stream per worker, and the group state.

A WorkerGroup is either attached (every worker reachable, joined, in ONE group incarnation) or not.
Losing any stream detaches the whole group at once: waiting steps fail immediately, the survivors are
asked to leave (a collective cannot heal), and the master waits for a NEW group incarnation.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from lopa.proto import worker_pb2, worker_pb2_grpc
from lopa.serving.master.errors import WorkerLost
from lopa.serving.shared.group_link import LinkSecurity

__all__ = ["WorkerGroup", "WorkerLink", "WorkerLost"]

log = logging.getLogger("lopa.master")
STARTUP_GRACE_S = 60.0  # workers loading a model are not alarming at first; past this they are

_CLOSED = object()
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # A restarted worker pod comes back under its old name at a new address: resolve the name again
    # within a second of a failed connection (gRPC's default waits 30 s between resolutions, which
    # kept a re-formed group NOT_SERVING for ~15 s after its workers were ready).
    ("grpc.dns_min_time_between_resolutions_ms", 1000),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    # Ping each worker every 5 s and drop it after 5 s without an answer: a frozen worker (stopped,
    # swapping, a hung host) takes the group to NOT_SERVING in ~10 s even while no step waits on it.
    # gRPC's own threads answer pings, so a long forward holding the GIL is not mistaken for one.
    # (Recent gRPC cores time pings out by ping_timeout_ms, older ones by keepalive_timeout_ms.)
    ("grpc.keepalive_time_ms", 5_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


class WorkerLink:
    def __init__(self, rank: int, address: str, security: LinkSecurity | None = None) -> None:
        self.rank, self.address = rank, address
        # Short reconnect backoff: a restarted group must be found in seconds, not minutes. Every call
        # presents the group secret (and the link's certificate with TLS: group_link).
        self.channel = (security or LinkSecurity()).channel(address, _CHANNEL_OPTIONS)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self._requests: queue.Queue[object] = queue.Queue()
        self._call: Any = None  # the Steps call: an iterator of replies and a grpc.Future
        self._deadline: float | None = None
        self._expired = False
        self.ended = False
        self.end_code: grpc.StatusCode | None = None

    def info(self, timeout: float) -> worker_pb2.WorkerInfo:
        return self.stub.Info(worker_pb2.InfoRequest(), timeout=timeout)

    def open(self, group: WorkerGroup) -> None:
        self._requests = queue.Queue()
        self._deadline, self._expired, self.ended = None, False, False
        self.end_code: grpc.StatusCode | None = None
        requests = self._requests

        def outgoing() -> Iterator[worker_pb2.StepRequest]:
            while (item := requests.get()) is not _CLOSED:
                yield item  # type: ignore[misc]

        call = self.stub.Steps(outgoing())
        self._call = call

        def ended(done: Any) -> None:  # the stream ended (worker died, or we cancelled it)
            self.end_code = done.code()
            self.ended = True
            busy = self.end_code == grpc.StatusCode.ABORTED  # serving another master: not a group failure
            group.lost(self.rank, f"worker rank {self.rank} ({self.address}) stream ended", leave=not busy)

        call.add_done_callback(ended)

    def send(self, request: worker_pb2.StepRequest) -> None:
        self._requests.put(request)

    def receive(self, timeout: float) -> worker_pb2.StepReply:
        """The next reply, read in the calling thread (no extra thread hop per step).

        A hung worker is bounded by the group's watchdog, which cancels the call past the deadline.
        """
        call = self._call
        if call is None:
            raise WorkerLost(f"worker rank {self.rank}: not attached")
        self._deadline = time.monotonic() + timeout
        try:
            return next(call)  # type: ignore[call-overload]
        except StopIteration:
            raise WorkerLost(f"worker rank {self.rank} ({self.address}) closed its stream") from None
        except grpc.RpcError as error:
            if self._expired:
                message = f"worker rank {self.rank} ({self.address}): no reply within {timeout:.0f}s"
            else:
                message = f"worker rank {self.rank} ({self.address}): {error.code().name}: {error.details()}"
            raise WorkerLost(message, busy=error.code() == grpc.StatusCode.ABORTED) from None
        finally:
            self._deadline = None

    def expire_if_late(self, now: float) -> None:
        deadline = self._deadline
        if deadline is not None and now > deadline and self._call is not None:
            self._expired = True
            self._call.cancel()

    def close(self) -> None:
        self._requests.put(_CLOSED)
        if self._call is not None:
            self._call.cancel()

    def leave(self, reason: str, group_id: str) -> None:
        with contextlib.suppress(grpc.RpcError):  # already gone
            self.stub.Leave(worker_pb2.LeaveRequest(reason=reason, group_id=group_id), timeout=2.0)


class WorkerGroup:
    """Attaches to all workers when they form one group; detaches on any loss."""

    def __init__(
        self, addresses: Sequence[str], probe_interval_s: float = 0.5, security: LinkSecurity | None = None
    ) -> None:
        self.links = [WorkerLink(rank, address, security) for rank, address in enumerate(addresses)]
        self.probe_interval_s = probe_interval_s
        self.detach_reason = ""  # why the group last detached
        self.lost_members = False
        self.group_id = ""
        self.vocab_size = 0
        self.max_length = 0
        self._lock = threading.Lock()
        self._attached = threading.Event()
        self._failed: set[str] = set()  # incarnations that lost a member: never attach to them again
        self._stop = threading.Event()
        self._last_waiting = ""
        self._last_log = 0.0
        self._started = time.monotonic()
        self._ever_attached = False
        self.listeners: list = []  # callables(attached: bool)
        # (vocab_size, max_length, max_batch) the master decodes with
        self.expected: tuple[int, int, int] | None = None
        self.step_tokens: list[int] = []  # the branch budget each worker measured (0: none)
        self.devices: list[str] = []  # where each worker's model runs ("" from a worker that does not say)

    @property
    def size(self) -> int:
        return len(self.links)

    @property
    def attached(self) -> bool:
        return self._attached.is_set()

    def start(self) -> None:
        self._started = time.monotonic()
        threading.Thread(target=self._monitor, name="lopa-group-monitor", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self._detach("master stopping", leave=False)

    def wait_attached(self, timeout: float) -> bool:
        return self._attached.wait(timeout)

    def lost(self, rank: int, reason: str, leave: bool = True) -> None:
        if self.attached:
            self._detach(f"lost worker rank {rank}: {reason}", leave=leave)

    # -- internals ----------------------------------------------------------------------------------

    def _monitor(self) -> None:
        while not self._stop.is_set():
            if not self.attached:
                self._try_attach()
            else:
                now = time.monotonic()
                for link in self.links:  # the watchdog of steps that wait too long
                    link.expire_if_late(now)
            self._stop.wait(self.probe_interval_s)

    def _try_attach(self) -> None:
        # long: the attach handshake, its checks in the order the group needs them
        infos, waiting = [], []
        for link in self.links:
            try:
                info = link.info(timeout=1.0)
            except grpc.RpcError as error:
                waiting.append(f"rank {link.rank} ({link.address}) unreachable: {error.code().name}")
                continue
            if info.rank != link.rank or info.world_size != self.size:
                waiting.append(
                    f"rank {link.rank} ({link.address}) reports rank {info.rank}/{info.world_size}, "
                    f"expected {link.rank}/{self.size}"
                )
            elif not info.joined:
                waiting.append(f"rank {link.rank} ({link.address}) has not joined the group")
            elif self.expected and (
                (info.vocab_size, info.max_length) != self.expected[:2] or info.max_batch < self.expected[2]
            ):
                vocab, max_length, max_batch = self.expected
                waiting.append(
                    f"rank {link.rank} ({link.address}) has vocab {info.vocab_size}, max_length "
                    f"{info.max_length}, max_batch {info.max_batch}; the master expects {vocab}, "
                    f"{max_length}, >= {max_batch} (same config file and model on every role?)"
                )
            elif info.master_attached:  # opening a stream now would be refused (ABORTED)
                waiting.append(f"rank {link.rank} ({link.address}) is serving another master")
            elif info.group_id in self._failed:
                waiting.append(f"rank {link.rank} ({link.address}) is still in failed group {info.group_id}")
            infos.append(info)
        if not waiting and len({i.group_id for i in infos}) != 1:
            waiting.append("workers report different groups: " + ", ".join(i.group_id for i in infos))
        if waiting:
            self._log_waiting("; ".join(waiting))
            return
        with self._lock:
            self.group_id = infos[0].group_id
            self.vocab_size, self.max_length = infos[0].vocab_size, infos[0].max_length
            self.step_tokens = [info.step_tokens for info in infos]
            self.devices = [info.device for info in infos]
            for link in self.links:
                link.open(self)
            self._attached.set()
        ended = [link for link in self.links if link.ended]
        if ended:  # a stream ended while we were attaching
            # ABORTED: a worker still serves another (possibly vanished) master: retry, keep the group.
            busy = all(link.end_code == grpc.StatusCode.ABORTED for link in ended)
            self._detach("a worker stream ended during attach", leave=not busy)
            return
        log.info("all %d workers joined group %s (on %s): SERVING", self.size, self.group_id,
                 ", ".join(sorted(set(self.devices))) or "an unnamed device")
        self._ever_attached = True
        self._last_waiting = ""
        self._notify(True)

    def _detach(self, reason: str, leave: bool) -> None:
        with self._lock:
            if not self._attached.is_set():
                return
            self._attached.clear()
            self.detach_reason = reason  # what a step that was waiting reports, not its own cancel
            self.lost_members = leave  # a member failed (not a stop, not a busy worker)
            group_id = self.group_id
            if leave:  # never attach to this incarnation again
                self._failed.add(group_id)
            for link in self.links:
                link.close()
        if leave:
            message = "worker group %s detached: %s; NOT_SERVING until the group is restarted"
            log.error(message, group_id, reason)
        else:
            log.info("worker group %s detached: %s", group_id, reason)
        self._notify(False)
        if leave:
            for link in self.links:
                link.leave(reason, group_id)

    def _notify(self, attached: bool) -> None:
        for listener in self.listeners:
            listener(attached)

    def _log_waiting(self, message: str) -> None:
        """The waiting reason, on change and every 10 s: INFO while the first group is still starting
        (workers load the model before they listen), WARNING once that takes long or after a loss."""
        now = time.monotonic()
        if message != self._last_waiting or now - self._last_log > 10.0:
            starting = not self._ever_attached and now - self._started < STARTUP_GRACE_S
            level = logging.INFO if starting else logging.WARNING
            log.log(level, "NOT_SERVING, waiting for workers: %s", message)
            self._last_waiting, self._last_log = message, now
