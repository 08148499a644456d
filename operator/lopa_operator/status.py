"""Derives the whole status (phase, counts, conditions, per-group state) from what exists: the one
writer of conditions."""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass
from typing import Any

from . import gang, group, names, placement

Pod = dict[str, Any]
CONDITION_TYPES = ("Available", "Progressing", "Degraded", "Schedulable", "CollectiveReady", "Reconciled")
OPTIONAL_CONDITION_TYPES = ("InferencePool",)  # only while spec.inferencePool.enabled
MESSAGE_LIMIT = 1000  # characters of an API error kept in a condition message
_INSUFFICIENT = re.compile(r"Insufficient ([\w./-]*\w)")


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


_SAME_NODE = "didn't match pod affinity rules"


def scheduling_problem(pods: list[Pod], held: str | None = None) -> tuple[str, str] | None:
    """(reason, message) naming what unschedulable pods lack, e.g. Insufficient nvidia.com/gpu.

    `held`: why Kueue holds the group behind its admission gate (gang.kueue_problem), when it does."""
    waiting = [p for p in pods if gang.gated(p)]
    if waiting:
        why = held or "its pods wait behind Kueue's admission gate"
        return "WaitingForQuota", (f"Kueue admits the group's {len(waiting)} waiting pod(s) only together, "
                                   f"once its ClusterQueue has room for all: {why}")
    stuck_pods = [(p, msg) for p in pods if (msg := unschedulable(p))]
    if not stuck_pods:
        return None
    stuck = [(p["metadata"]["name"], msg) for p, msg in stuck_pods]
    anchored = [(p["metadata"]["name"], msg, key) for p, msg in stuck_pods
                if _SAME_NODE in msg and (key := placement.required_domain(p))]
    if anchored:  # the cluster may have room, but not beside the group's first worker
        name, msg, key = anchored[0]
        if key == placement.HOSTNAME:
            reason = "GroupDoesNotFitOneNode"
            head = ("the group's workers must share one node (spec.placement.sameNode: Required) and the "
                    "node of its first lacks room")
        else:
            reason = "GroupDoesNotFitOneDomain"
            head = (f"the group's workers must share one {key} domain (spec.placement.topology: Required) "
                    "and the domain of its first lacks room")
        return reason, f"{head}: {len(stuck)} pod(s) cannot be scheduled; {name}: {msg}"
    missing = sorted({m for _, msg in stuck for m in _INSUFFICIENT.findall(msg)})
    reason = "InsufficientResources" if missing else "Unschedulable"
    head = f"Insufficient {', '.join(missing)}: " if missing else ""
    # The pod whose message names the shortfall (a gang's other pods only say the gang cannot form).
    name, msg = next(((n, m) for n, m in stuck if _INSUFFICIENT.search(m)), stuck[0])
    if any((p.get("spec") or {}).get("schedulingGroup") for p, _ in stuck_pods):
        head += "the group's pods are bound together or not at all (spec.scheduling.gang: Workload); "
    return reason, f"{head}{len(stuck)} pod(s) cannot be scheduled; {name}: {msg}"


def fetch_failure(pods: list[Pod]) -> str | None:
    """An init container (lopa fetch-model) that failed, as its pod tells it: the message the
    container's last log line left (FallbackToLogsOnError)."""
    for pod in pods:
        for c in (pod.get("status") or {}).get("initContainerStatuses") or []:
            for state in (c.get("state") or {}, c.get("lastState") or {}):
                ended = state.get("terminated")
                if ended and ended.get("exitCode", 0) != 0:
                    why = group.exit_reason_of(ended)
                    return f"pod {pod['metadata']['name']}: init container {c['name']} failed{why}"
    return None


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


@dataclass(frozen=True)
class GroupRound:
    """One group in this reconcile: its pods, what it runs toward and what decide() made of it."""

    index: int
    pods: list[Pod]  # its master and worker pods
    config_hash: str  # the spec's hash, or its old one while the rollout holds it
    wanted: int  # its worker count
    decision: group.Decision
    refused: bool = False  # never created: the API server refused its objects (Reconciled=False)
    held: str | None = None  # why Kueue holds its pods (gang.kueue_problem), while it does


@dataclass(frozen=True)
class _Seen:
    """What the status reports of one group."""

    round: GroupRound
    entry: dict[str, Any]  # its status.groups[] entry
    available: bool
    collective: bool
    degraded: bool
    progress: tuple[str, str]  # (reason, message) while it is not available
    collective_reason: tuple[str, str]
    ready_workers: int
    scheduling: tuple[str, str] | None  # (reason, message) when some of its pods cannot be placed


def _seen(g: GroupRound, old: dict[str, Any], now: dt.datetime) -> _Seen:
    # long: what one group's pods show, counted in one pass
    decision = g.decision
    deleted = {p["metadata"]["uid"] for p in decision.delete}
    alive = [p for p in g.pods if not group.is_terminating(p) and p["metadata"]["uid"] not in deleted]
    role = "app.kubernetes.io/component"
    workers = [p for p in alive if p["metadata"]["labels"].get(role) == names.ROLE_WORKER]
    masters = [p for p in alive if p["metadata"]["labels"].get(role) == names.ROLE_MASTER]
    ready_workers = sum(1 for p in workers if group.config_hash(p) == g.config_hash and pod_ready(p))
    master_ready = any(pod_ready(p) and group.config_hash(p) == g.config_hash for p in masters)
    formed = decision.state == group.GroupState.FORMED and bool(decision.memory.members)
    degraded = decision.state == group.GroupState.EXHAUSTED
    collective = formed and ready_workers == g.wanted and master_ready
    available = collective and not degraded
    sched = scheduling_problem(alive, g.held)
    fetch = fetch_failure(alive)
    master = f"master ready: {master_ready}"

    if available:
        progress = ("GroupServing", f"{ready_workers}/{g.wanted} workers joined; master serving")
    elif degraded:
        progress = ("GroupRestartsExhausted", decision.message)
    elif decision.state in _ACTING:
        progress = (_ACTING[decision.state], decision.message)
    elif fetch:
        progress = ("ModelFetchFailed", fetch)
    elif sched:
        progress = ("WaitingForScheduling", sched[1])
    elif g.refused and not g.pods:
        progress = (_NOT_CREATED, "not created: the API server refused its objects (see Reconciled)")
    else:
        progress = ("WaitingForPods", f"{ready_workers}/{g.wanted} worker pods ready; {master}")
    if collective:
        joined = ("GroupJoined", f"all {g.wanted} workers joined the {decision.state.lower()} group")
    elif not formed:
        joined = ("GroupNotFormed", decision.message)
    else:
        joined = ("WaitingForWorkers", f"{ready_workers}/{g.wanted} workers ready; {master}")

    since = old.get("availableSince") if old.get("available") else None
    entry = {
        "index": g.index,
        "state": str(decision.state),
        "available": available,
        "ready": f"{ready_workers}/{g.wanted}",
        "configHash": g.config_hash,
        "reason": progress[0],
        "message": progress[1],
        **({"availableSince": since or group.format_time(now)} if available else {}),
        **decision.memory.to_status(),
    }
    return _Seen(g, entry, available, collective, degraded, progress, joined, ready_workers, sched)


_NOT_CREATED = "GroupNotCreated"

_ACTING = {
    group.GroupState.ROLLING: "RollingGroup",
    group.GroupState.RESTARTING: "RestartingGroup",
    group.GroupState.BACKOFF: "GroupRestartBackoff",
}


def _about(replicas: int, index: int, message: str) -> str:
    """A group's message as the deployment tells it: named once there are several groups."""
    return message if replicas == 1 else f"group {index}: {message}"


def min_available(spec: dict[str, Any]) -> int:
    """Groups that must serve for the deployment to be Available (as a Deployment's maxUnavailable)."""
    replicas = spec["replicas"]
    return max(1, replicas - spec["rollout"]["maxUnavailable"]) if replicas else 0


@dataclass(frozen=True)
class _Tally:
    """What the groups add up to, against spec.replicas and the desired config."""

    replicas: int
    ready: int  # groups serving
    updated: int  # groups running the desired config
    everything: bool  # every group serving the desired config
    available: bool  # at least min_available groups serving
    degraded: list[_Seen]
    sched: tuple[str, str] | None  # the first stuck group's (reason, message)
    refused: bool  # a group the API server refused to create
    ready_workers: int
    progress: tuple[str, str]  # (reason, message) of Progressing
    not_joined: list[_Seen]
    joined: tuple[str, str]  # (reason, message) of CollectiveReady

    @property
    def phase(self) -> str:
        if self.degraded:
            return "Degraded"
        if self.everything:
            return "Available"
        return "Pending" if self.sched or self.refused else "Progressing"


def _tally(spec: dict[str, Any], rounds: list[GroupRound], seen: list[_Seen], desired_hash: str) -> _Tally:
    replicas = spec["replicas"]
    ready = sum(s.available for s in seen)
    updated = sum(g.config_hash == desired_hash for g in rounds)
    everything = ready == replicas and updated == replicas
    degraded = [s for s in seen if s.degraded]
    # The first stuck group's problem, named as every group's message is once there are several.
    stuck = next((s for s in seen if s.scheduling), None)
    sched = (stuck.scheduling[0], _about(replicas, stuck.round.index, stuck.scheduling[1])) if stuck else None
    ready_workers = sum(s.ready_workers for s in seen)
    waiting = [s for s in seen if not s.available or s.round.config_hash != desired_hash]
    if everything:
        progress = ("GroupServing", f"{ready}/{replicas} group(s) serving; {ready_workers} workers joined")
    elif degraded:
        progress = (
            "GroupRestartsExhausted",
            _about(replicas, degraded[0].round.index, degraded[0].progress[1]),
        )
    elif waiting:
        first = waiting[0]
        reason, message = (
            first.progress if not first.available else ("RollingGroup", "waits for its turn to roll")
        )
        progress = (reason, _about(replicas, first.round.index, message))
    else:  # scaling: groups still to be created or removed
        progress = ("Scaling", f"{ready}/{replicas} group(s) serving")
    not_joined = [s for s in seen if not s.collective]
    if not not_joined:
        joined = ("GroupJoined", f"every group's workers joined ({len(rounds)} group(s))")
    else:
        reason, message = not_joined[0].collective_reason
        joined = (reason, _about(replicas, not_joined[0].round.index, message))
    return _Tally(replicas, ready, updated, everything, ready >= min_available(spec), degraded, sched,
                  any(s.progress[0] == _NOT_CREATED for s in seen), ready_workers, progress, not_joined,
                  joined)


def _conditions(
    t: _Tally, spec: dict[str, Any], rounds: list[GroupRound], generation: int,
    rejected: dict[str, Any] | None, extra: list[dict[str, Any]] | None,
) -> list[dict[str, Any]]:
    available_message = (
        f"{t.ready}/{t.replicas} group(s) serving (at least {min_available(spec)} wanted)"
        if t.available
        else t.progress[1]
    )
    recent = sum(g.decision.memory.recent_restarts for g in rounds)
    return [
        _condition(
            "Available",
            t.available,
            "GroupServing" if t.available else t.progress[0],
            available_message,
            generation,
        ),
        # A group the API server refused does not progress until the spec (or the quota) changes.
        _condition("Progressing", not (t.everything or t.degraded or t.refused), *t.progress, generation),
        _condition(
            "Degraded",
            bool(t.degraded),
            "GroupRestartsExhausted" if t.degraded else "AsExpected",
            "; ".join(_about(t.replicas, s.round.index, s.round.decision.message) for s in t.degraded)
            or f"{recent} recent group restart(s)",
            generation,
        ),
        _condition(
            "Schedulable",
            t.sched is None,
            t.sched[0] if t.sched else "Scheduled",
            t.sched[1] if t.sched else "every pod is placed or waiting for its first placement",
            generation,
        ),
        _condition("CollectiveReady", not t.not_joined, t.joined[0], t.joined[1], generation),
        *({**c, "observedGeneration": c.get("observedGeneration", generation)} for c in extra or []),
        rejected or _condition("Reconciled", True, "Applied", "every child object was applied", generation),
    ]


def derive(
    obj: dict[str, Any],
    spec: dict[str, Any],
    rounds: list[GroupRound],
    desired_hash: str,
    now: dt.datetime,
    rejected: dict[str, Any] | None = None,
    extra: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The full status for `obj` (a merge patch: every key present, None clears).

    `extra`: conditions of optional children (type, status, reason, message: the InferencePool's),
    written before Reconciled.
    `rejected`: the Reconciled=False condition of a spec the API server refused (apply_failed).
    The groups then run what was deployed before, and the status describes that: `desired_hash`
    is the last applied config's and observedGeneration stays the last applied generation.
    """
    meta = obj["metadata"]
    name, namespace, generation = meta["name"], meta["namespace"], int(meta.get("generation") or 1)
    if rejected is not None:
        generation = int((obj.get("status") or {})["observedGeneration"])
    old = {e.get("index"): e for e in (obj.get("status") or {}).get("groups") or []}
    seen = [_seen(g, old.get(g.index) or {}, now) for g in rounds]
    t = _tally(spec, rounds, seen, desired_hash)
    conditions = _conditions(t, spec, rounds, generation, rejected, extra)
    stamp = group.format_time(now) or ""
    _keep_transition_times(conditions, (obj.get("status") or {}).get("conditions") or [], stamp)

    port = spec["service"]["port"]
    return {
        "observedGeneration": generation,
        "phase": t.phase,
        "replicas": sum(not r.refused for r in rounds),  # groups that exist (the scale subresource)
        "readyReplicas": t.ready,
        "updatedReplicas": t.updated,
        "selector": names.selector(name, names.ROLE_MASTER),
        "ready": f"{t.ready}/{t.replicas}",
        "readyWorkers": t.ready_workers,
        "workers": sum(g.wanted for g in rounds),
        "configHash": desired_hash,
        "endpoint": f"{names.client_service(name)}.{namespace}.svc:{port}",
        "groupRestarts": sum(g.decision.memory.total_restarts for g in rounds),
        "recentGroupRestarts": sum(g.decision.memory.recent_restarts for g in rounds),
        "groups": [s.entry for s in seen],
        "conditions": conditions,
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
