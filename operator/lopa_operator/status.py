"""Derives the whole status (phase, counts, conditions) from what exists: the one writer of conditions."""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

from . import group, names

Pod = dict[str, Any]
CONDITION_TYPES = ("Available", "Progressing", "Degraded", "Schedulable", "CollectiveReady", "Reconciled")
MESSAGE_LIMIT = 1000  # characters of an API error kept in a condition message
_INSUFFICIENT = re.compile(r"Insufficient ([\w./-]+)")


def pod_ready(pod: Pod) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def unschedulable(pod: Pod) -> str | None:
    """The scheduler's message for a Pending pod it could not place, else None."""
    status = pod.get("status") or {}
    if status.get("phase") not in (None, "Pending"):
        return None
    for c in status.get("conditions") or []:
        if (
            c.get("type") == "PodScheduled"
            and c.get("status") == "False"
            and c.get("reason") == "Unschedulable"
        ):
            return c.get("message") or "unschedulable"
    return None


def scheduling_problem(pods: list[Pod]) -> tuple[str, str] | None:
    """(reason, message) naming what unschedulable pods lack, e.g. Insufficient nvidia.com/gpu."""
    stuck = [(p["metadata"]["name"], msg) for p in pods if (msg := unschedulable(p))]
    if not stuck:
        return None
    missing = sorted({m for _, msg in stuck for m in _INSUFFICIENT.findall(msg)})
    reason = "InsufficientResources" if missing else "Unschedulable"
    head = f"Insufficient {', '.join(missing)}: " if missing else ""
    name, msg = stuck[0]
    return reason, f"{head}{len(stuck)} pod(s) cannot be scheduled; {name}: {msg}"


def _condition(kind: str, ok: bool, reason: str, message: str, generation: int) -> dict[str, Any]:
    return {
        "type": kind,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
    }


def _keep_transition_times(new: list[dict[str, Any]], old: list[dict[str, Any]], now: str) -> None:
    previous = {c.get("type"): c for c in old or []}
    for c in new:
        before = previous.get(c["type"])
        same = before is not None and before.get("status") == c["status"]
        c["lastTransitionTime"] = before.get("lastTransitionTime", now) if same and before else now


def derive(
    obj: dict[str, Any],
    spec: dict[str, Any],
    pods: list[Pod],
    desired_hash: str,
    decision: group.Decision,
    now: dt.datetime,
) -> dict[str, Any]:
    """The full status for `obj` (a merge patch: every key present, None clears)."""
    meta = obj["metadata"]
    name, namespace, generation = meta["name"], meta["namespace"], int(meta.get("generation") or 1)
    deleted = {p["metadata"]["uid"] for p in decision.delete}
    alive = [p for p in pods if not group.is_terminating(p) and p["metadata"]["uid"] not in deleted]
    role = "app.kubernetes.io/component"
    workers = [p for p in alive if p["metadata"]["labels"].get(role) == names.ROLE_WORKER]
    masters = [p for p in alive if p["metadata"]["labels"].get(role) == names.ROLE_MASTER]
    wanted = spec["branchParallelism"]
    current = [p for p in workers if group.config_hash(p) == desired_hash]
    ready_workers = sum(1 for p in current if pod_ready(p))
    master_ready = any(pod_ready(p) and group.config_hash(p) == desired_hash for p in masters)
    formed = decision.state == "Formed" and bool(decision.memory.members)

    sched = scheduling_problem(alive)
    degraded = decision.state == "Exhausted"
    collective = formed and ready_workers == wanted and master_ready
    available = collective and not degraded

    if available:
        progress = ("GroupServing", f"{ready_workers}/{wanted} workers joined; master serving")
    elif degraded:
        progress = ("GroupRestartsExhausted", decision.message)
    elif decision.state in ("Rolling", "Restarting", "Backoff"):
        progress = (
            {"Rolling": "RollingGroup", "Restarting": "RestartingGroup", "Backoff": "GroupRestartBackoff"}[
                decision.state
            ],
            decision.message,
        )
    elif sched:
        progress = ("WaitingForScheduling", sched[1])
    else:
        progress = (
            "WaitingForPods",
            f"{ready_workers}/{wanted} worker pods ready; master ready: {master_ready}",
        )

    if collective:
        collective_msg = ("GroupJoined", f"all {wanted} workers joined the {decision.state.lower()} group")
    elif not formed:
        collective_msg = ("GroupNotFormed", decision.message)
    else:
        collective_msg = (
            "WaitingForWorkers",
            f"{ready_workers}/{wanted} workers ready; master ready: {master_ready}",
        )

    conditions = [
        _condition(
            "Available", available, progress[0] if not available else "GroupServing", progress[1], generation
        ),
        _condition("Progressing", not available and not degraded, progress[0], progress[1], generation),
        _condition(
            "Degraded",
            degraded,
            "GroupRestartsExhausted" if degraded else "AsExpected",
            decision.message if degraded else f"{decision.memory.recent_restarts} recent group restart(s)",
            generation,
        ),
        _condition(
            "Schedulable",
            sched is None,
            sched[0] if sched else "Scheduled",
            sched[1] if sched else "every pod is placed or waiting for its first placement",
            generation,
        ),
        _condition("CollectiveReady", collective, collective_msg[0], collective_msg[1], generation),
        _condition("Reconciled", True, "Applied", "every child object was applied", generation),
    ]
    stamp = group.format_time(now) or ""
    _keep_transition_times(conditions, (obj.get("status") or {}).get("conditions") or [], stamp)

    phase = "Degraded" if degraded else "Available" if available else "Pending" if sched else "Progressing"
    port = spec["service"]["port"]
    return {
        "observedGeneration": generation,
        "phase": phase,
        "ready": f"{ready_workers}/{wanted}",
        "readyWorkers": ready_workers,
        "workers": wanted,
        "configHash": desired_hash,
        "endpoint": f"{names.client_service(name)}.{namespace}.svc:{port}",
        "conditions": conditions,
        **decision.memory.to_status(),
    }


def apply_failed(obj: dict[str, Any], message: str, now: dt.datetime) -> dict[str, Any]:
    """The status patch for a spec the API server rejects: Reconciled=False with its message.

    Everything else (observedGeneration included) keeps describing what is deployed, so the new
    generation is not claimed as observed.
    """
    generation = int(obj["metadata"].get("generation") or 1)
    if len(message) > MESSAGE_LIMIT:
        message = message[: MESSAGE_LIMIT - 3] + "..."
    old = (obj.get("status") or {}).get("conditions") or []
    failed = _condition("Reconciled", False, "ApplyFailed", message, generation)
    conditions = [c for c in old if c.get("type") != "Reconciled"] + [failed]
    _keep_transition_times([failed], old, group.format_time(now) or "")
    return {"conditions": conditions}
