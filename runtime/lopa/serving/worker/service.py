"""The worker process: load the model, join the group, serve the master's step stream.

The gRPC server starts before the join so the master can tell "unreachable" from "not joined
yet"; Steps is refused until the group is formed. A failed collective breaks the group for
good (a collective cannot heal), so the worker exits with code 3 and its supervisor restarts it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from lopa.decoding.executor import BranchWindow, PartOutcome, VerifyPart
from lopa.execution.faults import is_device_fault
from lopa.execution.shard import CommitOrder, ShardExecutor
from lopa.host.openmp import release_thread_pool
from lopa.model.loader import LoadedModel, load_model
from lopa.model.window import WindowedLM
from lopa.params import DecodingParams
from lopa.proto import worker_pb2, worker_pb2_grpc
from lopa.scheduling.calibration import measured_tokens
from lopa.scheduling.warmup import warm_graphs
from lopa.serving.shared import device_choice
from lopa.serving.shared.config import ServingConfig
from lopa.serving.shared.group_link import LinkSecurity
from lopa.serving.shared.listen import NO_REUSEPORT, add_port
from lopa.serving.shared.metrics import WorkerMetrics
from lopa.serving.shared.model_dir import model_path, usable_max_length
from lopa.serving.worker import collective
from lopa.serving.worker.kv_memory import check_kv_fits

log = logging.getLogger("lopa.worker")

EXIT_GROUP_LOST = 3
SERVER_OPTIONS = [
    NO_REUSEPORT,  # a second worker on the same port fails instead of sharing it
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # The master pings every 5 s (lopa.serving.master.group.links): allow it (the default minimum
    # is 5 minutes).
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 4_000),
    ("grpc.http2.max_ping_strikes", 0),
]


def params_of(begin: worker_pb2.Begin) -> DecodingParams:
    """The sampling knobs of a request (each candidate samples from its own stream of the seed:
    lopa.execution.local.SequenceState.stream), as the master admitted them."""
    return DecodingParams.trusted(
        attention=begin.attention,
        conf=begin.conf,
        temperature=begin.temperature,
        top_p=begin.top_p,
        top_k=begin.top_k,
        min_p=begin.min_p,
        seed=begin.seed,
    )


def windows_of(request: worker_pb2.StepPart) -> list[BranchWindow]:
    return [BranchWindow(list(w.tokens), list(w.block_ids), list(w.masked)) for w in request.windows]


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        rank: int,
        world_size: int,
        vocab_size: int,
        max_length: int,
        on_fatal: Callable[[int], None],
        metrics: WorkerMetrics | None = None,
        max_batch: int = 1,
        step_tokens: int = 0,
        device: str = "cpu",
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.vocab_size, self.max_length, self.max_batch = vocab_size, max_length, max_batch
        self.step_tokens = step_tokens  # its measured branch budget (0: none, see WorkerInfo)
        self.device = device  # where its model runs (model.device resolved)
        self.group: collective.Group | None = None
        self.shard: ShardExecutor | None = None
        self.on_fatal = on_fatal
        self.metrics = metrics
        self._attached = threading.Lock()  # one master stream at a time (held while it is open)
        self.last_step = time.monotonic()  # a draining worker leaves once its master went quiet

    @property
    def master_attached(self) -> bool:
        return self._attached.locked()

    def ready(self, group: collective.Group, shard: ShardExecutor) -> None:
        self.group, self.shard = group, shard

    def Info(self, request: worker_pb2.InfoRequest, context: grpc.ServicerContext) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(
            rank=self.rank,
            world_size=self.world_size,
            group_id=self.group.group_id if self.group else "",
            joined=self.shard is not None,
            vocab_size=self.vocab_size,
            max_length=self.max_length,
            max_batch=self.max_batch,
            step_tokens=self.step_tokens,
            master_attached=self.master_attached,
            device=self.device,
        )

    def Leave(self, request: worker_pb2.LeaveRequest, context: grpc.ServicerContext) -> worker_pb2.WorkerInfo:
        info = self.Info(worker_pb2.InfoRequest(), context)
        if self.group is not None and request.group_id in ("", self.group.group_id):
            log.error("rank %d leaving group %s: %s", self.rank, self.group.group_id, request.reason)
            threading.Timer(0.2, self.on_fatal, (EXIT_GROUP_LOST,)).start()
        return info

    def Steps(
        self, request_iterator: Iterator[worker_pb2.StepRequest], context: grpc.ServicerContext
    ) -> Iterator[worker_pb2.StepReply]:
        if self.shard is None:
            message = f"rank {self.rank} has not joined the group yet"
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, message)
        if not self._attached.acquire(blocking=False):
            context.abort(grpc.StatusCode.ABORTED, f"rank {self.rank}: another master stream is attached")
        try:
            for request in request_iterator:
                try:
                    reply = self.step(request)
                except ValueError as error:  # a malformed step: the master's bug, the group is intact
                    log.exception("rank %d: bad step", self.rank)
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"rank {self.rank}: {error}")
                except Exception as error:  # a collective or device failure: the group is gone
                    log.exception("rank %d: step failed; leaving the group", self.rank)
                    threading.Timer(0.2, self.on_fatal, (EXIT_GROUP_LOST,)).start()
                    context.abort(grpc.StatusCode.INTERNAL, f"rank {self.rank}: step failed: {error}")
                yield reply
        finally:
            self._attached.release()
            release_thread_pool()  # the next stream may come on another gRPC thread (lopa.host.openmp)

    def step(self, request: worker_pb2.StepRequest) -> worker_pb2.StepReply:
        """One round: Begins (local), the piggybacked commits (the collectives), this rank's rows of
        every request in one forward (local). A failure of a local part leaves the group consistent:
        it fails its request (a Begin, a request's sampling) or the round's requests (the forward),
        and the reply says so. A failed commit, or an accelerator fault, breaks the group: it
        propagates and the worker leaves."""
        self.last_step = time.monotonic()
        shard = self.shard
        assert shard is not None
        errors = self._begin(shard, request)
        began = time.perf_counter()
        orders = [CommitOrder(c.sequence, c.n, c.winner_rank, c.winner_slot, c.broadcast)
                  for c in request.commits]
        try:
            shard.commit_round(orders)
        except ValueError as error:
            # Not a malformed step with the group intact: the peers are in (or past) this commit's
            # broadcast, so the group is broken and this rank leaves it too (INTERNAL, exit 3).
            raise RuntimeError(f"commit failed: {error}") from error
        committed = time.perf_counter()
        parts = [
            VerifyPart(p.sequence, p.start, p.n_stage, windows_of(p) if i not in errors else [])
            for i, p in enumerate(request.parts)
        ]
        try:
            outcomes = shard.verify_round(parts)
        except ValueError:
            raise  # a malformed step: the master's bug (the caller aborts the stream)
        except Exception as error:
            message = self._local_failure(error)
            for part in request.parts:
                shard.drop_staged(part.sequence)  # nothing of this round may be committed
            return worker_pb2.StepReply(error=message)
        done = time.perf_counter()
        reply = worker_pb2.StepReply(forward_s=done - committed, commit_s=committed - began)
        self._add_stats(reply, request, outcomes, errors)
        if self.metrics is not None:
            rows = sum(len(p.windows) for p in request.parts)
            self.metrics.observe_step(reply.forward_s, reply.commit_s, rows, len(request.parts))
        return reply

    def _begin(self, shard: ShardExecutor, request: worker_pb2.StepRequest) -> dict[int, str]:
        """Start the round's new requests; returns index into request.parts -> why it failed here."""
        errors: dict[int, str] = {}
        for index, part in enumerate(request.parts):
            if not part.sequence < self.max_batch:  # a malformed step: the master's bug
                raise ValueError(f"sequence {part.sequence} outside [0, max_batch={self.max_batch})")
            if part.HasField("begin"):
                try:
                    shard.begin(params_of(part.begin), max(1, part.begin.num_rows), part.sequence,
                                part.begin.excluded_ids, part.begin.alternatives)
                except Exception as error:  # bad sampling settings: this request fails, not the round
                    errors[index] = self._local_failure(error)
        return errors

    def _add_stats(
        self, reply: worker_pb2.StepReply, request: worker_pb2.StepRequest, outcomes: list[PartOutcome],
        errors: dict[int, str],
    ) -> None:
        """Each request's statistics (or why it failed here), in the order of request.parts."""
        for index, (part, outcome) in enumerate(zip(request.parts, outcomes, strict=True)):
            stats = reply.parts.add()
            if index in errors:
                stats.error = errors[index]
            elif isinstance(outcome, Exception):
                stats.error = self._local_failure(outcome)
            elif not part.cache_only:
                for row in outcome:  # packed repeated fields: one message per branch, not per position
                    stats.branches.add(
                        tokens=[s.token for s in row],
                        probs=[s.prob for s in row],
                        confs=[s.conf for s in row],
                        alternative_tokens=[t for s in row for t, _ in s.alternatives],
                        alternative_logprobs=[lp for s in row for _, lp in s.alternatives],
                    )

    def _local_failure(self, error: Exception) -> str:
        """A failure that leaves the group intact becomes a message; a device fault propagates."""
        if is_device_fault(error):
            raise error  # the device is unusable: leave the group
        log.warning("rank %d: a request's step failed (the group is intact): %r", self.rank, error)
        return f"{type(error).__name__}: {error}"


def serve_worker(config: ServingConfig, rank: int, stop: threading.Event | None = None) -> int:
    """Run a worker until stopped; returns the exit code (raises JoinError when the join fails)."""
    given, config = config, device_choice.resolve(config)  # auto: this machine's device and its backend
    log.info("rank %d: %s", rank, device_choice.start_line(config, given))
    workers, model_cfg = config.workers, config.model
    collective.check_backend(workers.backend, model_cfg.device)
    collective.prepare_device(model_cfg.device)
    if not 0 <= rank < workers.count:
        raise ValueError(f"--rank: {rank} outside [0, workers.count={workers.count})")
    model = WorkerModel.load(config)
    metrics = WorkerMetrics.start(workers.metrics_port, rank)
    exit_code: list[int] = []
    stop = stop or threading.Event()

    def fatal(code: int) -> None:
        exit_code.append(code)
        stop.set()

    service = WorkerService(rank, workers.count, model.loaded.config.vocab_size, model.max_length, fatal,
                            metrics, config.limits.max_batch, model.measured or 0, model_cfg.device)
    address = listen_address(config, rank)
    security = LinkSecurity.load(workers)
    server = start_server(service, address, listen_key(config, rank), security)
    if metrics is not None:
        metrics.reserved_bytes.set(model.reserved)
        metrics.watch_forwards(lambda: dict(model.window.forwards))
        metrics.watch_captures(model.window.graph_captures)
    log.info(
        "rank %d: model %s loaded; %d KV sequences (limits.max_batch) of %d tokens reserved %.1f MiB; "
        "worker API on %s", rank, model.path, config.limits.max_batch, model.max_length,
        model.reserved / (1 << 20), address,
    )
    try:
        group = collective.join(workers.backend, workers.rendezvous, rank, workers.count, model_cfg.device,
                                workers.join_timeout_s, workers.step_timeout_s, security)
        # Steps run on a gRPC thread, not this one (lopa.host.openmp): hand this thread's pool back
        # before the first step can come (ready). Released while a step's parallel region runs, the
        # pause is undefined in OpenMP, and a main thread stuck in it never installs its SIGTERM drain.
        release_thread_pool()
        service.ready(group, ShardExecutor(model.window, rank, group.broadcast, model.loaded.special.pad,
                                           workers.count))
        if metrics is not None:
            metrics.joined.set(1)
        log.info("rank %d ready (group %s, %d workers)", rank, group.group_id, workers.count)
        _serve_joined(service, stop, config.limits.request_timeout_s)
    finally:
        server.stop(grace=1.0)
    return exit_code[0] if exit_code else 0


@dataclass(frozen=True)
class WorkerModel:
    """A worker's model, loaded on its device with its KV caches reserved."""

    path: Path
    loaded: LoadedModel
    window: WindowedLM
    max_length: int
    reserved: int  # bytes of its KV caches and staging
    measured: int | None  # the branch budget its forwards measured (None: not measured)

    @classmethod
    def load(cls, config: ServingConfig) -> WorkerModel:
        model_cfg = config.model
        path = model_path(model_cfg.path)
        max_length = usable_max_length(config, path)  # before the (long) load: a bad config fails at once
        loaded = load_model(path, model_cfg.adapter or None, model_cfg.dtype, model_cfg.device,
                            weights=model_cfg.weights)
        element_size = loaded.model.model.embed_tokens.weight.element_size()  # the KV caches' (model) dtype
        check_kv_fits(config, loaded.config, max_length, loaded.model.device, element_size)
        window = loaded.window_model(max_length, max_batch=config.limits.max_batch)
        # limits.max_step_tokens = 0 on an accelerator: measured here, run by the master (the smallest)
        measured = None if config.limits.max_step_tokens else measured_tokens(window, model_cfg.device)
        # The graphs of the likely rounds, before this worker joins (the master serves once all joined).
        warm_graphs(window, config.decoding, config.limits.max_step_tokens or measured)
        return cls(path, loaded, window, max_length, window.reserved_bytes(), measured)


def _serve_joined(service: WorkerService, stop: threading.Event, request_timeout_s: float) -> None:
    """Serve the master's steps until stopped or, after a SIGTERM, drained."""
    drain = Drain()
    if threading.current_thread() is threading.main_thread():
        # Joined: SIGTERM now drains (until here it stops at once: a join cannot be interrupted).
        signal.signal(signal.SIGTERM, drain.request)
    while not stop.wait(0.2):
        why = drain.done(service.last_step, request_timeout_s, service.master_attached)
        if why:
            log.info("rank %d: drained (%s), leaving", service.rank, why)
            break


# A draining worker leaves once no step arrived for this long since its SIGTERM. Longer than the
# master pod's preStop sleep (lopa_operator.pods.PRE_STOP_SLEEP_S, 5 s): a master deleted with its
# workers (a rollout, a scale-down) still admits requests until its own SIGTERM comes.
QUIET_S = 7.0


class Drain:
    """SIGTERM came (a pod deletion, which stops the master too): keep serving the master's steps
    while it drains its requests; leave once no master is attached, once it went quiet, or after
    the longest a request may last."""

    def __init__(self) -> None:
        self.began: float | None = None

    def request(self, *_: object) -> None:
        self.began = self.began or time.monotonic()

    def done(self, last_step: float, limit_s: float, attached: bool) -> str:
        """Why the drain is over ("" while it is not)."""
        if self.began is None:
            return ""
        now = time.monotonic()
        if not attached:
            return "no master attached"
        if now - max(last_step, self.began) >= QUIET_S:  # idle before SIGTERM: still wait from it
            return f"no step for {QUIET_S:.0f} s"
        # The master may have admitted a request up to QUIET_S after this SIGTERM (its preStop sleep).
        return "the longest a request may last passed" if now - self.began >= limit_s + QUIET_S else ""


def start_server(
    service: WorkerService, address: str, key: str = "workers.listen_port",
    security: LinkSecurity | None = None,
) -> grpc.Server:
    """The worker API on `address`, for the group's master only (security: group_link); OSError naming
    the config key `key` when it cannot bind."""
    security = security or LinkSecurity()
    # Keepalive: a master that vanished without closing its stream frees the worker in seconds.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=SERVER_OPTIONS,
                         interceptors=security.interceptors())
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    add_port(server, address, key, security.server_credentials())
    server.start()
    return server


def listen_address(config: ServingConfig, rank: int) -> str:
    """In a pod, workers.listen_port on every interface (the master dials the pod's DNS name); with
    listen_port 0 (local runs: every rank on one host), exactly this rank's own address, so a
    loopback group is not reachable from the network."""
    if config.workers.listen_port:
        return f"0.0.0.0:{config.workers.listen_port}"
    return config.workers.addresses[rank]


def listen_key(config: ServingConfig, rank: int) -> str:
    """The config key listen_address() took the address from (for bind errors)."""
    return "workers.listen_port" if config.workers.listen_port else f"workers.addresses[{rank}]"


def exit_now(code: int) -> None:
    """Leave without running collective teardown (it could block on a dead peer)."""
    logging.shutdown()
    os._exit(code)
