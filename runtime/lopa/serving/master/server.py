"""The `lopa master` process: builds the request pipeline and serves it.

The pipeline: the served model and admission, the scheduler over the group's DistributedExecutor,
the dispatcher; then its doors: the gRPC server (client API + grpc.health.v1, an optional plaintext
health port) and the optional OpenAI-compatible HTTP API. The worker group's state drives health,
metrics and the branch budget; SIGTERM drains.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from lopa import __version__
from lopa.decoding.decoder import Decoder
from lopa.scheduling.budget import Budget, configured_budget, joined_budget, measured_on
from lopa.scheduling.scheduler import Scheduler
from lopa.serving.master.admission import Admission
from lopa.serving.master.api.grpc_parsing import add_lopa_servicer
from lopa.serving.master.api.grpc_service import SERVICE, LopaService
from lopa.serving.master.dispatch import Dispatcher
from lopa.serving.master.group.distributed import DistributedExecutor, StepTiming
from lopa.serving.master.group.links import WorkerGroup
from lopa.serving.master.observer import MasterObserver
from lopa.serving.master.served import ServedModel
from lopa.serving.shared.config import API_KEY_ENV, AUTO, ServingConfig
from lopa.serving.shared.group_link import LinkSecurity
from lopa.serving.shared.listen import add_port, grpc_server_options, host_of
from lopa.serving.shared.log_limits import limit_repeats, raise_descriptor_limit
from lopa.serving.shared.metrics import MasterMetrics
from lopa.serving.shared.model_dir import model_path
from lopa.serving.shared.tls import server_credentials

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger("lopa.master")
HEALTH_PORT_CONNECTIONS = 64  # the plaintext health port's (probes only)


@dataclass
class Pipeline:
    """The master's request pipeline, whatever door a request comes in by."""

    served: ServedModel
    group: WorkerGroup
    scheduler: Scheduler
    dispatcher: Dispatcher
    metrics: MasterMetrics

    @classmethod
    def build(cls, config: ServingConfig, served: ServedModel, metrics: MasterMetrics) -> Pipeline:
        limits = config.limits
        group = WorkerGroup(config.workers.addresses, security=LinkSecurity.load(config.workers))
        group.expected = (served.config.vocab_size, served.max_length, limits.max_batch)

        def observe_step(timing: StepTiming) -> None:
            metrics.step_seconds.labels("forward").observe(timing.forward_s)
            metrics.step_seconds.labels("commit").observe(timing.commit_s)
            metrics.step_seconds.labels("coordination").observe(timing.coordination_s)

        executor = DistributedExecutor(group, config.workers.step_timeout_s, observe_step, limits.max_batch)
        decoder = Decoder(executor, served.special.mask, served.special.eos, served.max_length)
        device = budget_device(config, group)
        budget = configured_budget(limits.max_step_tokens, device)
        observer = MasterObserver(metrics)
        scheduler = Scheduler(decoder, executor, served.decode, limits.queue_size, budget, observer)
        dispatcher = Dispatcher(Admission.of(served), scheduler, served.decode, metrics,
                                lambda: group.attached, limits.request_timeout_s)
        return cls(served, group, scheduler, dispatcher, metrics)

    def serving(self) -> bool:
        """What health says: the group is attached and the master admits requests."""
        return self.group.attached and not self.dispatcher.draining

    def adopt_budget(self, measured: Sequence[int], config: ServingConfig) -> None:
        """Run the budget the joined workers measured at start (lopa.scheduling.budget.joined_budget)."""
        device = budget_device(config, self.group)
        budget = joined_budget(config.limits.max_step_tokens, measured, device, config.model.device == AUTO)
        if budget is None:
            return
        self.scheduler.set_budget(budget)
        how = (f"measured by the workers at start: {', '.join(map(str, measured))} tokens"
               if min(measured, default=0) > 0 else "a worker did not measure it: the fixed default")
        log.info("branch budget: %s (%s)", budget.describe(), how)


async def serve_master(
    config: ServingConfig, started: asyncio.Event | None = None, drain: asyncio.Event | None = None
) -> None:
    """Run the master until cancelled, or until `drain` is set and its requests are done."""
    limit_repeats()
    raise_descriptor_limit()
    served = ServedModel.load(config, model_path(config.model.path))
    metrics = MasterMetrics.create(served.name)
    host = host_of(config.master.listen)  # every client-facing port binds the host of master.listen
    metrics.serve(config.master.metrics_port, host)
    pipeline = Pipeline.build(config, served, metrics)
    group = pipeline.group
    health = health_aio.HealthServicer()
    for name in ("", SERVICE):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    server, health_server, secure = grpc_servers(config, pipeline, health)
    await server.start()
    if health_server is not None:
        await health_server.start()
    http = None
    try:  # from here on every exit stops what started (an HTTP port in use included)
        if config.master.http_port:
            http = await start_openai_http(config, pipeline, host)
        group.listeners.append(group_listener(config, pipeline, health, asyncio.get_running_loop()))
        group.start()
        pipeline.dispatcher.start()
        log.info("lopa %s master listening on %s (%s), %d workers: %s", __version__, config.master.listen,
                 "TLS" if secure else "plaintext", group.size, ", ".join(config.workers.addresses))
        log_batching(config, pipeline.scheduler.budget)
        if started is not None:
            started.set()
        if drain is None:
            await server.wait_for_termination()
        else:
            await drain.wait()
            await drain_requests(pipeline, health, config.limits.request_timeout_s)
    finally:
        # Requests still in flight end first, each with its error (a stream's error event); then the
        # HTTP port closes, giving its handlers a few seconds to write it.
        pipeline.dispatcher.stop()
        if http is not None:
            await http.cleanup()
        group.stop()
        if health_server is not None:
            await health_server.stop(grace=None)
        await server.stop(grace=2.0)


def grpc_bounds(config: ServingConfig, max_message_bytes: int | None, max_connections: int | None = None
                ) -> list[tuple[str, Any]]:
    """The master's gRPC server options: the connection bounds of master.grpc_*, calls in flight
    given up to limits.request_timeout_s to end when their connection ages out."""
    master = config.master
    return grpc_server_options(max_connections or master.grpc_max_connections,
                               master.grpc_handshake_timeout_s, master.grpc_idle_timeout_s,
                               master.grpc_max_connection_age_s, config.limits.request_timeout_s,
                               max_message_bytes)


def grpc_servers(
    config: ServingConfig, pipeline: Pipeline, health: health_aio.HealthServicer
) -> tuple[grpc.aio.Server, grpc.aio.Server | None, bool]:
    """(the client API's server, the plaintext health port's or None, whether the API is on TLS),
    bound to their ports, not started. With API keys (LOPA_API_KEY) the API's calls need one, as the
    HTTP API's do; health stays open."""
    from lopa.serving.master.api.grpc_keys import KeyInterceptor
    from lopa.serving.master.keys import api_keys

    keys = api_keys()
    server = grpc.aio.server(interceptors=[KeyInterceptor(keys)] if keys else None,
                             options=grpc_bounds(config, pipeline.dispatcher.admission.max_message_bytes))
    # a request that does not parse: INVALID_ARGUMENT, not UNKNOWN
    add_lopa_servicer(LopaService(pipeline.dispatcher, pipeline.served), server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    listen = config.master.listen
    credentials = server_credentials(config.tls)
    add_port(server, listen, "master.listen", credentials)
    health_server = None
    if config.master.health_port:
        # grpc.health.v1 alone, plaintext, with the same servicer: the kubelet's gRPC probe speaks no
        # TLS, and a TCP check of master.listen passes before the group has formed.
        health_server = grpc.aio.server(options=grpc_bounds(config, None, HEALTH_PORT_CONNECTIONS))
        health_pb2_grpc.add_HealthServicer_to_server(health, health_server)
        health_listen = f"{listen.rpartition(':')[0]}:{config.master.health_port}"
        add_port(health_server, health_listen, "master.health_port")
    return server, health_server, credentials is not None


async def start_openai_http(config: ServingConfig, pipeline: Pipeline, host: str) -> web.AppRunner:
    """The OpenAI-compatible HTTP API on master.http_port, bounded by the master.http_* keys and the
    admission's limits, started (its runner, to clean up)."""
    from lopa.serving.master.api.connection_guard import HttpBounds
    from lopa.serving.master.api.openai_http import OpenAIApi, start_http
    from lopa.serving.master.keys import api_keys

    master, admission, metrics = config.master, pipeline.dispatcher.admission, pipeline.metrics
    bounds = HttpBounds(master.http_max_connections, master.http_header_timeout_s,
                        master.http_keepalive_timeout_s, master.http_body_timeout_s,
                        master.http_min_body_rate, master.http_max_connections_per_client)
    keys = api_keys()
    api = OpenAIApi(pipeline.dispatcher, pipeline.served.names, config.limits.queue_size, pipeline.serving,
                    metrics.registry, bounds, admission.max_body_bytes, admission.max_body_values, keys)
    runner = await start_http(api, host, master.http_port, config.tls,
                              lambda reason: metrics.http_refused.labels(reason).inc(), master.access_log)
    log.info("OpenAI-compatible HTTP API on %s port %d, model %s%s", host, master.http_port,
             " / ".join(repr(name) for name in api.names),
             f", {len(keys)} API key(s) ({API_KEY_ENV})" if keys else ", no API key")
    return runner


def group_listener(
    config: ServingConfig, pipeline: Pipeline, health: health_aio.HealthServicer,
    loop: asyncio.AbstractEventLoop,
) -> Callable[[bool], None]:
    """What the group's attaching and detaching change (from its monitor thread): the budget the
    workers measured, health, the group metrics."""
    group, metrics = pipeline.group, pipeline.metrics

    def on_group(attached: bool) -> None:
        if attached:
            pipeline.adopt_budget(group.step_tokens, config)
        serving = health_pb2.HealthCheckResponse
        status = serving.SERVING if pipeline.serving() else serving.NOT_SERVING
        metrics.workers_joined.set(group.size if attached else 0)
        if attached:
            metrics.group_attaches.inc()
        elif group.lost_members:
            metrics.group_losses.inc()
        for name in ("", SERVICE):
            asyncio.run_coroutine_threadsafe(health.set(name, status), loop)

    return on_group


async def drain_requests(pipeline: Pipeline, health: health_aio.HealthServicer, limit_s: float) -> None:
    """Stop admitting (health NOT_SERVING, new requests UNAVAILABLE), let the queued and running
    requests finish, for at most the longest a request may last; stop early if the group is gone
    (nothing more can finish)."""
    dispatcher = pipeline.dispatcher
    dispatcher.draining = True
    for name in ("", SERVICE):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    deadline = time.monotonic() + limit_s
    log.info("draining: %d running, %d queued (at most %.1f s)", pipeline.scheduler.running,
             pipeline.scheduler.waiting, limit_s)
    while dispatcher.busy() and pipeline.group.attached and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    log.info("drained" if not dispatcher.busy() else "drain ended with requests left (group lost or timeout)")


def budget_device(config: ServingConfig, group: WorkerGroup) -> str:
    """The device whose default branch budget the group runs: model.device, or with auto the device
    the joined workers report (the CPU's until they join)."""
    if config.model.device != AUTO:
        return config.model.device
    return next((device for device in group.devices if device), "cpu")


def log_batching(config: ServingConfig, budget: Budget) -> None:
    limits, device = config.limits, config.model.device
    source = "limits.max_step_tokens" if limits.max_step_tokens else f"the {device} default"
    if not limits.max_step_tokens and device == AUTO:
        source = "the default of the workers' device (model.device auto), once they join"
    elif not limits.max_step_tokens and measured_on(device):
        source += ", until the workers report the budget they measure at start"
    log.info("batching: %d requests at once (limits.max_batch), branch budget %s (%s)", limits.max_batch,
             budget.describe(), source)
