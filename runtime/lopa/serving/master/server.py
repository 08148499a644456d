"""The `lopa master` process: the gRPC server (client API + grpc.health.v1, an optional plaintext
health port), the optional OpenAI-compatible HTTP API, the worker group's wiring to health and
metrics, and the drain on SIGTERM. The API itself is service.LopaService.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from lopa import __version__
from lopa.scheduling.budget import measured_on
from lopa.serving.master.links import WorkerGroup
from lopa.serving.master.service import SERVICE, LopaService
from lopa.serving.master.undecodable import add_lopa_servicer
from lopa.serving.shared.config import ServingConfig
from lopa.serving.shared.listen import NO_REUSEPORT, add_port
from lopa.serving.shared.metrics import MasterMetrics
from lopa.serving.shared.model_dir import model_path
from lopa.serving.shared.tls import server_credentials

log = logging.getLogger("lopa.master")


async def serve_master(
    config: ServingConfig, started: asyncio.Event | None = None, drain: asyncio.Event | None = None
) -> None:
    """Run the master until cancelled, or until `drain` is set and its requests are done."""
    path = model_path(config.model.path)
    metrics = MasterMetrics.create()
    metrics.serve(config.master.metrics_port)
    group = WorkerGroup(config.workers.addresses)
    service = LopaService(config, path, group, metrics)
    health = health_aio.HealthServicer()
    loop = asyncio.get_running_loop()

    def on_group(attached: bool) -> None:
        if attached:
            service.adopt_budget(group.step_tokens)
        serving = health_pb2.HealthCheckResponse
        status = serving.SERVING if attached and not service.draining else serving.NOT_SERVING
        metrics.workers_joined.set(group.size if attached else 0)
        if attached:
            metrics.group_attaches.inc()
        elif group.lost_members:
            metrics.group_losses.inc()
        for name in ("", SERVICE):
            asyncio.run_coroutine_threadsafe(health.set(name, status), loop)

    server = grpc.aio.server(options=[NO_REUSEPORT])
    add_lopa_servicer(service, server)  # a request that does not parse: INVALID_ARGUMENT, not UNKNOWN
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    for name in ("", SERVICE):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    listen = config.master.listen
    credentials = server_credentials(config.tls)
    add_port(server, listen, "master.listen", credentials)
    health_server = None
    if config.master.health_port:
        # grpc.health.v1 alone, plaintext, with the same servicer: the kubelet's gRPC probe speaks no
        # TLS, and a TCP check of master.listen passes before the group has formed.
        health_server = grpc.aio.server(options=[NO_REUSEPORT])
        health_pb2_grpc.add_HealthServicer_to_server(health, health_server)
        add_port(health_server, f"0.0.0.0:{config.master.health_port}", "master.health_port")
    await server.start()
    if health_server is not None:
        await health_server.start()
    http = None
    try:  # from here on every exit stops what started (an HTTP port in use included)
        if config.master.http_port:
            from lopa.serving.master.http_api import start_http

            name = served_model_name(config, path)
            http = await start_http(service, name, config.master.http_port, config.tls)
            log.info("OpenAI-compatible HTTP API on port %d, model %r", config.master.http_port, name)
        group.listeners.append(on_group)
        group.start()
        service.runner.start()
        log.info("lopa %s master listening on %s (%s), %d workers: %s", __version__, listen,
                 "TLS" if credentials else "plaintext", group.size, ", ".join(config.workers.addresses))
        log_batching(config, service)
        if started is not None:
            started.set()
        if drain is None:
            await server.wait_for_termination()
        else:
            await drain.wait()
            await drain_requests(service, health, group, config.limits.request_timeout_s)
    finally:
        if http is not None:
            await http.cleanup()
        service.runner.stop()
        group.stop()
        if health_server is not None:
            await health_server.stop(grace=None)
        await server.stop(grace=2.0)


async def drain_requests(service: LopaService, health: health_aio.HealthServicer, group: WorkerGroup,
                         limit_s: float) -> None:
    """Stop admitting (health NOT_SERVING, new requests UNAVAILABLE), let the queued and running
    requests finish, for at most the longest a request may last; stop early if the group is gone
    (nothing more can finish)."""
    service.draining = True
    for name in ("", SERVICE):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    deadline = time.monotonic() + limit_s
    log.info("draining: %d running, %d queued (at most %.1f s)", service.runner.scheduler.running,
             service.runner.scheduler.waiting, limit_s)
    while service.busy() and group.attached and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    log.info("drained" if not service.busy() else "drain ended with requests left (group lost or timeout)")


def log_batching(config: ServingConfig, service: LopaService) -> None:
    limits, device = config.limits, config.model.device
    source = "limits.max_step_tokens" if limits.max_step_tokens else f"the {device} default"
    if not limits.max_step_tokens and measured_on(device):
        source += ", until the workers report the budget they measure at start"
    log.info("batching: %d requests at once (limits.max_batch), branch budget %s (%s)", limits.max_batch,
             service.budget.describe(), source)


def served_model_name(config: ServingConfig, path: Path) -> str:
    """master.model_name, else the checkpoint directory's name ("lopa-bundled" for the bundled one)."""
    if config.master.model_name:
        return config.master.model_name
    from lopa.bundled import bundled_model_dir

    return "lopa-bundled" if path.resolve() == bundled_model_dir().resolve() else path.name
