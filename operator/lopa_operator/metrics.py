"""Prometheus metrics of the operator itself (not of the runtime pods)."""

from __future__ import annotations

import contextlib

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server

RECONCILES = Counter(
    "lopa_operator_reconciles_total", "Reconciles by trigger and result", ["trigger", "result"]
)
RECONCILE_SECONDS = Histogram("lopa_operator_reconcile_seconds", "Duration of one reconcile", ["trigger"])
GROUP_RESTARTS = Counter(
    "lopa_operator_group_restarts_total", "Worker groups recreated after a lost member", ["namespace", "name"]
)
GROUP_ROLLS = Counter(
    "lopa_operator_group_rolls_total", "Worker pods rolled for a new config", ["namespace", "name"]
)
CHILD_APPLIES = Counter(
    "lopa_operator_child_applies_total",
    "Children a reconcile server-side applied (applied) or found unchanged since its last apply (unchanged)",
    ["kind", "outcome"],
)
READY_WORKERS = Gauge("lopa_operator_ready_workers", "Ready worker pods", ["namespace", "name"])
WANTED_WORKERS = Gauge("lopa_operator_wanted_workers", "Worker pods in the spec", ["namespace", "name"])
READY_GROUPS = Gauge("lopa_operator_ready_groups", "Groups serving (Available)", ["namespace", "name"])
WANTED_GROUPS = Gauge(
    "lopa_operator_wanted_groups", "Groups in the spec (spec.replicas)", ["namespace", "name"]
)
PHASE = Gauge(
    "lopa_operator_phase", "1 for the current phase of each deployment", ["namespace", "name", "phase"]
)
PHASES = ("Pending", "Progressing", "Available", "Degraded")

_started = False


def serve(port: int) -> None:
    """Starts the /metrics endpoint once (port 0 disables it)."""
    global _started
    if port and not _started:
        start_http_server(port, registry=REGISTRY)
        _started = True


def observe(namespace: str, name: str, status: dict) -> None:
    READY_WORKERS.labels(namespace, name).set(status.get("readyWorkers") or 0)
    WANTED_WORKERS.labels(namespace, name).set(status.get("workers") or 0)
    READY_GROUPS.labels(namespace, name).set(status.get("readyReplicas") or 0)
    WANTED_GROUPS.labels(namespace, name).set(len(status.get("groups") or []))
    for phase in PHASES:
        PHASE.labels(namespace, name, phase).set(1 if status.get("phase") == phase else 0)


def forget(namespace: str, name: str) -> None:
    """Drops the series of a deleted deployment."""
    for gauge in (READY_WORKERS, WANTED_WORKERS, READY_GROUPS, WANTED_GROUPS):
        with contextlib.suppress(KeyError):
            gauge.remove(namespace, name)
    for phase in PHASES:
        with contextlib.suppress(KeyError):
            PHASE.remove(namespace, name, phase)
