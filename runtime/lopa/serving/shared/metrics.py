"""Prometheus metrics of both roles, each in its own registry (a process may host both in tests)."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import MetricsHandler
from prometheus_client.registry import Collector

from lopa.serving.shared.vllm_metrics import Occupancy, VllmMetrics

log = logging.getLogger("lopa.metrics")
_STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_TPF_BUCKETS = (1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
_BRANCH_BUCKETS = (0, 1, 2, 3, 4, 5, 7, 9, 11, 15)
_TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)


@dataclass
class MasterMetrics:
    registry: CollectorRegistry
    requests: Counter
    tokens: Counter
    forwards: Counter
    verified_tokens: Counter  # window tokens verified for completed requests (every branch row)
    tpf: Histogram
    step_seconds: Histogram  # label phase: forward | coordination | commit
    workers_joined: Gauge
    request_seconds: Histogram  # arrival to answer, every outcome
    queue_seconds: Histogram  # arrival to the start of decoding
    ttft_seconds: Histogram  # arrival to the first committed token, completed requests
    tpot_seconds: Histogram  # after the first token, seconds per further token, completed requests
    group_attaches: Counter  # the worker group formed (again)
    group_losses: Counter  # the worker group was lost (a worker died, froze or left)
    batch_size: Histogram  # requests per round (one batched forward)
    branches_granted: Histogram  # lookahead branches each request got per round
    branches_cut: Counter  # lookahead branches the budget took away
    vllm: VllmMetrics  # the same measurements under vLLM's names (lopa.serving.shared.vllm_metrics)
    occupancy: Occupancy  # the queue and the KV sequences, lopa's and vLLM's gauges from one snapshot
    http_refused: Counter  # HTTP connections refused or evicted at the port's limits, by reason

    @classmethod
    def create(cls, model_name: str = "") -> MasterMetrics:
        # long: the master's metrics, one declaration each
        r = CollectorRegistry()
        occupancy = Occupancy(model_name)
        r.register(occupancy)
        return cls(
            registry=r,
            vllm=VllmMetrics.create(r, model_name),
            occupancy=occupancy,
            requests=Counter("lopa_requests", "Requests by outcome", ["outcome"], registry=r),
            tokens=Counter("lopa_generated_tokens", "Generated tokens (up to the first EOS)", registry=r),
            forwards=Counter("lopa_forwards", "Verification rounds", registry=r),
            verified_tokens=Counter(
                "lopa_verified_tokens", "Window tokens verified for completed requests (every branch row)",
                registry=r,
            ),
            tpf=Histogram("lopa_tpf", "Tokens per forward of each request", buckets=_TPF_BUCKETS, registry=r),
            step_seconds=Histogram(
                "lopa_step_seconds", "Step time by phase", ["phase"], buckets=_STEP_BUCKETS, registry=r
            ),
            workers_joined=Gauge("lopa_workers_joined", "Workers attached to the master", registry=r),
            request_seconds=Histogram(
                "lopa_request_seconds", "Request latency, arrival to answer", buckets=_REQUEST_BUCKETS,
                registry=r,
            ),
            queue_seconds=Histogram(
                "lopa_queue_seconds", "Time a request waited before decoding", buckets=_REQUEST_BUCKETS,
                registry=r,
            ),
            ttft_seconds=Histogram(
                "lopa_time_to_first_token_seconds",
                "Arrival to the first committed token (completed requests)",
                buckets=_REQUEST_BUCKETS, registry=r,
            ),
            tpot_seconds=Histogram(
                "lopa_time_per_output_token_seconds",
                "After the first token, seconds per further generated token (completed requests)",
                buckets=_TOKEN_BUCKETS, registry=r,
            ),
            group_attaches=Counter("lopa_group_attaches", "Times the worker group formed", registry=r),
            group_losses=Counter("lopa_group_losses", "Times the worker group was lost", registry=r),
            batch_size=Histogram(
                "lopa_batch_size", "Requests per round (one batched forward)", buckets=_BATCH_BUCKETS,
                registry=r,
            ),
            branches_granted=Histogram(
                "lopa_branches_granted", "Lookahead branches granted per request per round",
                buckets=_BRANCH_BUCKETS, registry=r,
            ),
            branches_cut=Counter(
                "lopa_branches_cut",
                "Lookahead branches the budget took away (those a round could spawn, up to k, minus granted)",
                registry=r,
            ),
            http_refused=Counter(
                "lopa_http_connections_refused",
                "HTTP connections refused or evicted at the port's limits (reason: full, idle, slow, "
                "client_cap, not_a_probe)", ["reason"], registry=r,
            ),
        )

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        serve_registry(self.registry, port, "master.metrics_port", host)


@dataclass
class WorkerMetrics:
    registry: CollectorRegistry
    forward_seconds: Histogram
    commit_seconds: Histogram
    branches: Counter
    steps: Counter
    joined: Gauge
    requests: Histogram  # requests in each round's forward
    reserved_bytes: Gauge  # KV caches + staging allocated at start

    @classmethod
    def create(cls, rank: int) -> WorkerMetrics:
        r = CollectorRegistry()
        labels = {"rank": str(rank)}
        return cls(
            registry=r,
            forward_seconds=Histogram(
                "lopa_worker_forward_seconds", "Batched forward + statistics per step", buckets=_STEP_BUCKETS,
                registry=r,
            ),
            commit_seconds=Histogram(
                "lopa_worker_commit_seconds", "Applying a commit (broadcast included)", buckets=_STEP_BUCKETS,
                registry=r,
            ),
            branches=Counter("lopa_worker_branches", "Branches verified", registry=r),
            steps=Counter("lopa_worker_steps", "Steps served", registry=r),
            joined=Gauge("lopa_worker_joined", "1 once the collective group is formed", ["rank"], registry=r)
            .labels(**labels),
            requests=Histogram(
                "lopa_worker_batch_size", "Requests per round's forward", buckets=_BATCH_BUCKETS, registry=r
            ),
            reserved_bytes=Gauge(
                "lopa_worker_kv_reserved_bytes", "KV cache bytes reserved at start", registry=r
            ),
        )

    @classmethod
    def start(cls, port: int, rank: int) -> WorkerMetrics:
        metrics = cls.create(rank)
        serve_registry(metrics.registry, port, "workers.metrics_port")
        return metrics

    def watch_forwards(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """Export the window model's forwards by path (`graph`: replayed from a CUDA graph, `eager`),
        read at every scrape: a GPU whose graphs fell back to eager forwards shows it here."""
        self.registry.register(_ForwardsByPath(counts))

    def watch_captures(self, stats: Callable[[], tuple[int, float]]) -> None:
        """Export the CUDA graphs captured (count, seconds), read at every scrape: a capture is paid by
        the round that first needs its shape, so a latency spike beside a growing count is one."""
        self.registry.register(_GraphCaptures(stats))

    def observe_step(self, forward_s: float, commit_s: float, branches: int, requests: int = 1) -> None:
        self.forward_seconds.observe(forward_s)
        self.commit_seconds.observe(commit_s)
        self.branches.inc(branches)
        self.steps.inc()
        self.requests.observe(requests)


class _ForwardsByPath(Collector):
    def __init__(self, counts: Callable[[], Mapping[str, int]]) -> None:
        self.counts = counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        help_text = "Verification forwards by path (graph: a CUDA graph replay)"
        family = CounterMetricFamily("lopa_worker_forwards", help_text, labels=["path"])
        for path, count in sorted(self.counts().items()):
            family.add_metric([path], count)
        yield family


class _GraphCaptures(Collector):
    def __init__(self, stats: Callable[[], tuple[int, float]]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        count, seconds = self.stats()
        yield CounterMetricFamily("lopa_worker_graph_captures", "CUDA graphs captured", value=count)
        yield CounterMetricFamily(
            "lopa_worker_graph_capture_seconds", "Wall time spent capturing CUDA graphs", value=seconds
        )


METRICS_CONNECTIONS = 16  # scrapes served at once
METRICS_READ_TIMEOUT_S = 10.0  # a scrape's request head must arrive within this, in all


class _BoundedServer(ThreadingHTTPServer):
    """A thread per scrape, at most METRICS_CONNECTIONS of them: held connections cannot pile up
    threads or descriptors. A connection whose request head has not arrived within
    METRICS_READ_TIMEOUT_S in all is cut (a client trickling a byte at a time never reaches a
    per-read timeout); at the limit a new connection takes the place of the oldest one still sending
    its head, so such clients cannot keep a scraper out."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._lock = threading.Lock()
        self._open = 0
        self._reading: dict[socket.socket, float] = {}  # still sending its head -> its deadline, oldest first
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            if self._open >= METRICS_CONNECTIONS:
                victim = next(iter(self._reading), None)
                if victim is None:  # every one is being answered: this one waits for none
                    self.shutdown_request(request)
                    return
                del self._reading[victim]
                _cut(victim)  # its thread sees the end of its input and ends
            self._open += 1
            self._reading[request] = time.monotonic() + METRICS_READ_TIMEOUT_S
        super().process_request(request, client_address)

    def head_read(self, request: Any) -> None:
        with self._lock:
            self._reading.pop(request, None)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._open -= 1
                self._reading.pop(request, None)

    def service_actions(self) -> None:
        """Between accepts (every half second at most): cut the heads past their deadline."""
        now = time.monotonic()
        with self._lock:
            late = [request for request, deadline in self._reading.items() if deadline <= now]
            for request in late:
                del self._reading[request]
                _cut(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("metrics scrape from %s failed", client_address, exc_info=True)


def _cut(request: socket.socket) -> None:
    with contextlib.suppress(OSError):
        request.shutdown(socket.SHUT_RDWR)


def serve_registry(registry: CollectorRegistry, port: int, key: str, host: str = "0.0.0.0") -> None:
    """/metrics on host:port (0: none; any other path is a 404), on a bounded server; OSError naming
    the config key when the port is taken."""
    if not port:
        return

    class Handler(MetricsHandler.factory(registry)):  # type: ignore[misc]
        timeout = METRICS_READ_TIMEOUT_S  # each read; the head as a whole: _BoundedServer's deadline

        def parse_request(self) -> bool:
            parsed = bool(super().parse_request())
            self.server.head_read(self.connection)
            return parsed

        def log_message(self, format: str, *args: Any) -> None:  # a scrape is no news
            pass

        def do_GET(self) -> None:
            # prometheus_client answers any path with the metrics; only /metrics (with a query) is.
            if self.path.split("?", 1)[0] not in ("/metrics", "/metrics/"):
                self.send_error(404, "not found: the metrics are at /metrics")
                return
            super().do_GET()

    try:
        server = _BoundedServer((host, port), Handler)
    except OSError as error:
        raise OSError(f"{key}: cannot listen on port {port}: {error.strerror or error}") from None
    threading.Thread(target=server.serve_forever, name="lopa-metrics", daemon=True).start()
