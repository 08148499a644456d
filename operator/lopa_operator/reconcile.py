"""One idempotent reconcile: apply children, enforce the group policy, write status and events.

Called from create/update/resume handlers and from the resync timer; it always re-reads the
object so that a stale watch body cannot double-count a group restart.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, MutableMapping
from dataclasses import replace
from typing import Any

import kopf

from . import config, credentials, gang, group, inference_pool, metrics, names, network, render, rollout
from . import spec as specs
from . import status as statuses
from .applied import Versions, apply_changed, live_versions
from .kube import Kube, KubeError, path
from .ownership import refuse_foreign, spec_error
from .settings import current

EventFn = Callable[[dict[str, Any], str, str, str], None]  # (object, type, reason, message)

Memo = MutableMapping[str, Any]  # kopf's per-object memo (a plain dict in unit tests)
_memo_guard = threading.Lock()


def _lock(memo: Memo) -> threading.Lock:
    # The handlers and the timer of one object run in worker threads: one reconcile at a time.
    with _memo_guard:
        return memo.setdefault("reconcile_lock", threading.Lock())


def forget(namespace: str, name: str) -> None:
    """Drops what outlives a deleted object outside its memo: its metric series."""
    metrics.forget(namespace, name)


def _ensure(
    kube: Kube, children: list[dict[str, Any]], owner: dict[str, Any], memo: Memo, live: Versions
) -> None:
    """Server-side applies the children: creates them and repairs drift. A rendering not yet
    validated is first dry-run applied as a whole, so that a child the API server rejects leaves
    every child as it was (no new ConfigMap beside old pods). The memo keeps the digest of the last
    rendering that passed: only a new rendering needs the dry run. A rendering the API server
    refused is refused again from the memo, without a call, for the retry_refused_s setting (it does not
    heal by retrying soon; every resync still looks after the deployed groups, and a new rendering
    is tried at once). Every resync applies the children that drifted or are not in `live` (the
    children this round read anyway): lopa_operator.applied."""
    for child in children:
        kopf.append_owner_reference(child, owner=owner)
    rendered = config.digest(children)
    if memo.get("validated") != rendered:
        refused = memo.get("refused")
        if refused and refused[0] == rendered and time.monotonic() - refused[1] < current().retry_refused_s:
            raise refused[2]
        try:
            for child in children:
                refuse_foreign(kube, child, owner)
                try:
                    kube.apply(child, dry_run=True)
                except KubeError as error:
                    raise gang.explain(error, child) from error
        except KubeError as error:
            if spec_error(error):
                memo["refused"] = (rendered, time.monotonic(), error)
            raise
        memo["validated"] = rendered
        memo.pop("refused", None)
    apply_changed(kube, children, memo, live)


def _rejection(
    obj: dict[str, Any],
    error: KubeError,
    post: EventFn,
    logger: logging.Logger | logging.LoggerAdapter,
) -> dict[str, Any]:
    """The status patch for a spec the API server rejects: its conditions with Reconciled=False last
    (statuses.apply_failed). One Warning event per new message."""
    meta = obj["metadata"]
    message = error.message  # the API server's own words, naming the object and the field
    patch = statuses.apply_failed(obj, message, dt.datetime.now(dt.timezone.utc))
    failed = patch["conditions"][-1]
    old = _reconciled(obj)
    if not old or old.get("status") != "False" or old.get("message") != failed["message"]:
        post(obj, "Warning", "ApplyFailed", failed["message"])  # and logged once, not every resync
        logger.info("spec of generation %s rejected by the API server: %s", meta.get("generation"), message)
    return patch


def _reconciled(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The object's Reconciled condition as last written."""
    conditions = (obj.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == "Reconciled"), None)


def _report_only(kube: Kube, obj: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """Writes just the conditions, for a deployment with nothing deployed to look after yet."""
    meta = obj["metadata"]
    if _reconciled(obj) != patch["conditions"][-1]:
        kube.patch_status(meta["namespace"], meta["name"], patch)
    return patch


def _events(
    obj: dict[str, Any],
    before: dict[str, Any],
    after: dict[str, Any],
    rounds: list[statuses.GroupRound],
    removed: tuple[int, ...],
    post: EventFn,
) -> None:
    replicas = len(rounds)
    for g in rounds:
        about = g.decision.message if replicas == 1 else f"group {g.index}: {g.decision.message}"
        if g.decision.state == group.GroupState.ROLLING:
            post(obj, "Normal", "RollingGroup", about)
        elif g.decision.state == group.GroupState.RESTARTING:
            post(obj, "Warning", "GroupRestart", about)
    if removed:
        post(obj, "Normal", "ScaledDown", f"removed group(s) {', '.join(map(str, removed))} (spec.replicas)")
    old = {c["type"]: c for c in before.get("conditions") or []}
    for c in after["conditions"]:
        prev = old.get(c["type"])
        if prev and prev.get("status") == c["status"] and prev.get("reason") == c["reason"]:
            continue
        if c["type"] == "Available" and c["status"] == "True":
            post(obj, "Normal", "Available", c["message"])
        elif c["type"] == "Schedulable" and c["status"] == "False":
            post(obj, "Warning", "Unschedulable", c["message"])
        elif c["type"] == "Degraded" and c["status"] == "True":
            post(obj, "Warning", "Degraded", c["message"])


def reconcile(
    kube: Kube,
    namespace: str,
    name: str,
    trigger: str,
    post: EventFn,
    logger: logging.Logger | logging.LoggerAdapter,
    memo: Memo,
) -> dict[str, Any] | None:
    """Brings the children of one LoPADeployment in line and returns the status written."""
    started = time.monotonic()
    result = "error"
    try:
        with _lock(memo):
            obj = kube.get(path(names.KIND, namespace, name))
            if obj is None or obj["metadata"].get("deletionTimestamp"):
                result = "gone"
                return None  # owner references let the garbage collector remove the children
            out = _reconcile(kube, obj, post, logger, memo)
            result = "ok"
            return out
    finally:
        metrics.RECONCILES.labels(trigger, result).inc()
        metrics.RECONCILE_SECONDS.labels(trigger).observe(time.monotonic() - started)


def _reconcile(
    kube: Kube, obj: dict[str, Any], post: EventFn, logger: logging.Logger | logging.LoggerAdapter, memo: Memo
) -> dict[str, Any]:
    # long: one reconcile pass, its steps in the order they apply
    meta = obj["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    spec = specs.with_defaults(obj.get("spec"))
    desired_hash = render.group_hash(name, namespace, spec)
    before = obj.get("status") or {}
    entries = {e.get("index"): e for e in before.get("groups") or []}

    ours = names.selector(name)
    worker_sets, masters = kube.list("StatefulSet", namespace, ours), kube.list("Deployment", namespace, ours)
    # One pod list serves the whole reconcile: applying children changes no pod at once, and the
    # deletions below only reach groups beyond spec.replicas, which no round looks at.
    pods = kube.list("Pod", namespace, ours)
    deployed = rollout.deployed_groups(worker_sets, masters, entries, pods)
    plan = rollout.plan(deployed, spec["replicas"], desired_hash, spec["rollout"]["maxUnavailable"])
    raw = obj.get("spec") or {}
    secrets, stored = _group_secrets(kube, memo, name, namespace, spec, plan.update)
    config_maps = kube.list("ConfigMap", namespace, ours)
    live = live_versions({"StatefulSet": worker_sets, "Deployment": masters, "ConfigMap": config_maps,
                          "Secret": stored})
    held = _held_masters(spec, plan.update, masters, pods)
    children = [c for i in plan.update
                for c in render.group_children(name, namespace, raw, i, secrets[i], i in held)]
    rejected: dict[str, Any] | None = None  # the Reconciled=False condition of a refused spec
    try:
        gang.check_queue(kube, namespace, spec)
        _ensure(kube, children + render.shared_children(name, namespace, raw), obj, memo, live)
    except KubeError as e:
        if not spec_error(e):
            raise
        patch = _rejection(obj, e, post, logger)
        if not deployed or not before.get("observedGeneration") or not before.get("configHash"):
            return _report_only(kube, obj, patch)
        rejected = patch["conditions"][-1]
        # Nothing of the refused spec was applied (dry run first): the groups keep running what
        # they run, and a worker lost meanwhile must still be handled and reported.
        plan = rollout.hold_deployed(plan, deployed)
        secrets = {}
    in_force = before["configHash"] if rejected else desired_hash
    _remove_orphans(kube, obj, spec, deployed, worker_sets, masters, config_maps, logger,
                    rejected is not None)
    if not rejected:
        _remove_unwanted(kube, obj, spec, memo, children, plan.hold, pods)
    extra = _pool_condition(kube, obj, spec, memo, post, before, rejected)

    now = dt.datetime.now(dt.timezone.utc)
    rounds = _group_rounds(kube, obj, spec, pods, plan, deployed, entries, in_force, secrets, rejected, now,
                           logger)

    after = statuses.derive(obj, spec, rounds, in_force, now, rejected, extra)
    if any(before.get(k) != v for k, v in after.items()):
        kube.patch_status(namespace, name, after)
    _events(obj, before, after, rounds, plan.remove, post)
    metrics.observe(namespace, name, after)
    # A refused spec raises nothing: kopf would hold this object's handlers and timer for the retry's
    # delay (a fix or a lost worker then waited a minute); the timer retries it (_ensure's memo).
    return after


def _group_secrets(
    kube: Kube, memo: Memo, name: str, namespace: str, spec: dict[str, Any], groups: tuple[int, ...]
) -> tuple[dict[int, Any], list[dict[str, Any]]]:
    """Each group's Secret data, taken as it is and made anew only where credentials.py says so,
    and the Secrets as read (what the server holds, for applied.live_versions)."""
    stored = {i: kube.get(path("Secret", namespace, names.group_secret(name, i))) for i in groups}
    data = {i: credentials.pending(memo, stored[i], name, namespace, i, spec) for i in groups}
    return data, [s for s in stored.values() if s is not None]


def _remove_orphans(
    kube: Kube, obj: dict[str, Any], spec: dict[str, Any], deployed: dict[int, rollout.Deployed],
    worker_sets: list[dict], masters: list[dict], config_maps: list[dict],
    logger: logging.Logger | logging.LoggerAdapter, held: bool,
) -> None:
    """Delete the children no group of spec.replicas owns (none while a refused spec holds the groups)."""
    meta = obj["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    listed = {"StatefulSet": worker_sets, "Deployment": masters, "ConfigMap": config_maps}
    # An operator from before groups left unlabelled children: they serve until enough groups do.
    legacy_too = sum(d.available for d in deployed.values()) >= statuses.min_available(spec)
    doomed = {k: [] if held else rollout.unexpected(objs, spec["replicas"], legacy_too)
              for k, objs in listed.items()}  # (a list's items carry no kind)
    # A removed group's Secret goes first: found by its group's other children, never listed.
    removed = {names.group_of(c) for objs in doomed.values() for c in objs} - {None}
    for index in sorted(i for i in removed if i is not None):
        kube.delete("Secret", namespace, names.group_secret(name, index))
        for role in network.ROLES:
            kube.delete("NetworkPolicy", namespace, names.network_policy(name, index, role))
    for kind, objs in doomed.items():
        for child in objs:
            kube.delete(kind, namespace, child["metadata"]["name"], uid=child["metadata"]["uid"])
            logger.info("deleted %s %s: no group of spec.replicas owns it", kind, child["metadata"]["name"])


def _group_rounds(
    kube: Kube, obj: dict[str, Any], spec: dict[str, Any], pods: list[dict], plan: rollout.Plan,
    deployed: dict[int, rollout.Deployed], entries: dict[Any, dict], in_force: str, secrets: dict[int, Any],
    rejected: dict[str, Any] | None, now: dt.datetime, logger: logging.Logger | logging.LoggerAdapter,
) -> list[statuses.GroupRound]:
    """Every group's decision this round (lopa_operator.group), acted on."""
    meta = obj["metadata"]
    rounds = []
    for index in range(spec["replicas"]):
        if index in plan.hold:
            config_hash, wanted = rollout.held_state(deployed[index])
        else:
            config_hash, wanted = in_force, spec["branchParallelism"]
        entry = entries.get(index) or {}
        memory = group.Memory.from_status(entry)
        if entry and entry.get("configHash") != config_hash:
            # A new config gets a fresh restart budget; a scale or a Service change does not.
            memory = replace(memory, recent_restarts=0)
        mine = [p for p in pods if names.group_of(p) == index]
        workers = [p for p in mine if p["metadata"]["labels"].get(_ROLE) == names.ROLE_WORKER]
        secret_hash = credentials.digest(secrets[index]) if index in secrets else None
        decision = group.decide(workers, wanted, config_hash, memory, spec["failurePolicy"], now, secret_hash)
        _act(kube, meta["namespace"], meta["name"], index, decision, logger)
        refused = rejected is not None and index not in plan.hold
        waits = gang.kueue_problem(kube, meta["namespace"], mine) if any(map(gang.gated, mine)) else None
        rounds.append(statuses.GroupRound(index, mine, config_hash, wanted, decision, refused, waits))
    return rounds


_ROLE = "app.kubernetes.io/component"


def _remove_unwanted(
    kube: Kube, obj: dict[str, Any], spec: dict[str, Any], memo: Memo, children: list[dict[str, Any]],
    held: tuple[int, ...], pods: list[dict[str, Any]],
) -> None:
    """Deletes the optional children the spec no longer wants: the NetworkPolicies, the gang's
    Workload and the PodGroups no group (applied or held) and no pod names."""
    meta = obj["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    _unfence(kube, obj, spec, memo)
    _remove_workload_unless(gang.mode(spec) == gang.WORKLOAD, kube, memo, namespace, name)
    if gang.mode(spec) == gang.WORKLOAD:
        wanted = {c["metadata"]["name"] for c in children if c["kind"] == "PodGroup"}
        wanted |= {gang.pod_group_name(name, i, spec) for i in held}
        listed = kube.list("PodGroup", namespace, names.selector(name))
        for stale in gang.stale_pod_groups(listed, wanted, pods):
            kube.delete("PodGroup", namespace, stale)


def _unfence(kube: Kube, obj: dict[str, Any], spec: dict[str, Any], memo: Memo) -> None:
    """Deletes the groups' NetworkPolicies when the spec turns them off (once, not every resync, while
    it does not want them), and, once per operator run, a deployment-wide policy this CR controls
    (names.deployment_network_policy)."""
    meta = obj["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    if network.enabled(spec):
        memo.pop("absent:NetworkPolicy", None)
    elif not memo.get("absent:NetworkPolicy"):
        for index in range(spec["replicas"]):
            for role in network.ROLES:
                kube.delete("NetworkPolicy", namespace, names.network_policy(name, index, role))
        memo["absent:NetworkPolicy"] = True
    if memo.get("deployment_policy_checked"):
        return
    wide = kube.get(path("NetworkPolicy", namespace, names.deployment_network_policy(name)))
    refs = ((wide or {}).get("metadata") or {}).get("ownerReferences") or []
    if any(r.get("controller") and r.get("uid") == meta["uid"] for r in refs):
        kube.delete("NetworkPolicy", namespace, wide["metadata"]["name"], uid=wide["metadata"]["uid"])
    memo["deployment_policy_checked"] = True


def _held_masters(
    spec: dict[str, Any], groups: tuple[int, ...], masters: list[dict[str, Any]], pods: list[dict[str, Any]]
) -> set[int]:
    """The groups whose master waits for Kueue to admit their workers (gang.hold_master)."""
    by_index = {names.group_of(m): m for m in masters}
    workers = [p for p in pods if p["metadata"]["labels"].get(_ROLE) == names.ROLE_WORKER]
    return {i for i in groups
            if gang.hold_master(spec, by_index.get(i), [p for p in workers if names.group_of(p) == i])}


def _remove_workload_unless(wanted: bool, kube: Kube, memo: Memo, namespace: str, name: str) -> None:
    """Gang Workload turned off: its Workload and the groups' PodGroups go, looked for once. A
    cluster without the Workload API (404), or an operator not granted it (403, an install from
    before gang scheduling), made none."""
    if wanted:
        memo.pop("absent:Workload", None)
    elif not memo.get("absent:Workload"):
        try:
            found = kube.get(path("Workload", namespace, name))
        except KubeError as error:
            if error.status not in (403, 404):
                raise
            found = None
        if found is not None:
            for pod_group in kube.list("PodGroup", namespace, names.selector(name)):
                kube.delete("PodGroup", namespace, pod_group["metadata"]["name"])
            kube.delete("Workload", namespace, name)
        memo["absent:Workload"] = True


def _pool_condition(
    kube: Kube, obj: dict[str, Any], spec: dict[str, Any], memo: Memo, post: EventFn,
    before: dict[str, Any], rejected: dict[str, Any] | None,
) -> list[dict[str, Any]]:
    """The InferencePool condition, as extra conditions of the status: none without a pool. A refused
    spec applies nothing of itself, so the last reported condition stands."""
    if rejected:
        return [c for c in before.get("conditions") or [] if c.get("type") == inference_pool.CONDITION]
    condition = inference_pool.sync(kube, obj, spec, memo, post)
    return [condition] if condition else []


def _act(
    kube: Kube,
    namespace: str,
    name: str,
    index: int,
    decision: group.Decision,
    logger: logging.Logger | logging.LoggerAdapter,
) -> None:
    """Deletes the worker pods a group decision names, and counts it."""
    for pod in decision.delete:
        kube.delete("Pod", namespace, pod["metadata"]["name"], uid=pod["metadata"]["uid"])
    if decision.delete:
        # info, not warning: kopf would turn a warning into a second Kubernetes event.
        logger.info(
            "group %d %s: %s (deleted %d pod(s))",
            index,
            decision.state,
            decision.message,
            len(decision.delete),
        )
    if decision.counted:
        metrics.GROUP_RESTARTS.labels(namespace, name).inc()
    elif decision.state == group.GroupState.ROLLING:
        metrics.GROUP_ROLLS.labels(namespace, name).inc(len(decision.delete))
