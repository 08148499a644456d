"""Unit tests of the group failure policy and status derivation (pure functions)."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace

from lopa_operator import group, names, status
from lopa_operator import spec as specs

NOW = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.timezone.utc)
POLICY = specs.with_defaults({})["failurePolicy"]
HASH = "h1"


def pod(
    name: str,
    uid: str,
    *,
    role: str = "worker",
    phase: str = "Running",
    ready: bool = True,
    restarts: int = 0,
    config_hash: str = HASH,
    deleting: bool = False,
    unschedulable: str = "",
) -> dict:
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    if unschedulable:
        phase = "Pending"
        conditions = [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": unschedulable}
        ]
    meta = {
        "name": name,
        "uid": uid,
        "labels": {"app.kubernetes.io/component": role},
        "annotations": {names.CONFIG_HASH_ANNOTATION: config_hash},
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": meta,
        "status": {
            "phase": phase,
            "conditions": conditions,
            "containerStatuses": [{"name": role, "restartCount": restarts}],
        },
    }


def formed(uids: tuple[str, ...] = ("a", "b"), **kw: object) -> group.Memory:
    members = tuple((f"d-worker-{i}", uid, 0) for i, uid in enumerate(uids))
    return group.Memory(members=members, formed_at=NOW - dt.timedelta(seconds=5), **kw)  # type: ignore[arg-type]


def test_group_forms_once_every_worker_runs() -> None:
    pods = [pod("d-worker-0", "a"), pod("d-worker-1", "b", phase="Pending")]
    assert group.decide(pods, 2, HASH, group.Memory(), POLICY, NOW).state == "Forming"
    pods[1] = pod("d-worker-1", "b")
    decision = group.decide(pods, 2, HASH, group.Memory(), POLICY, NOW)
    assert decision.state == "Formed" and not decision.delete
    assert decision.memory.members == (("d-worker-0", "a", 0), ("d-worker-1", "b", 0))


def test_lost_worker_recreates_whole_group() -> None:
    # worker-1 was deleted and the StatefulSet already made a new one: a new UID.
    pods = [pod("d-worker-0", "a"), pod("d-worker-1", "b2")]
    decision = group.decide(pods, 2, HASH, formed(), POLICY, NOW)
    assert decision.state == "Restarting" and decision.counted
    assert sorted(p["metadata"]["uid"] for p in decision.delete) == ["a", "b2"]
    assert decision.memory.total_restarts == 1 and decision.memory.recent_restarts == 1
    assert decision.memory.members == ()
    assert "d-worker-1 was replaced" in decision.message


def test_missing_and_restarted_workers_are_failures() -> None:
    missing = group.decide([pod("d-worker-0", "a")], 2, HASH, formed(), POLICY, NOW)
    assert missing.state == "Restarting" and "lost" in missing.message
    restarted = [pod("d-worker-0", "a"), pod("d-worker-1", "b", restarts=1)]
    decision = group.decide(restarted, 2, HASH, formed(), POLICY, NOW)
    assert decision.state == "Restarting" and "restarted" in decision.message


def test_backoff_then_exhausted() -> None:
    pods = [pod("d-worker-0", "a"), pod("d-worker-1", "b2")]
    recent = formed(recent_restarts=2, total_restarts=2, last_restart=NOW - dt.timedelta(seconds=5))
    # third restart waits backoff * 2^(2-1) = 20 s after the last one
    assert group.decide(pods, 2, HASH, recent, POLICY, NOW).state == "Backoff"
    later = NOW + dt.timedelta(seconds=30)
    assert group.decide(pods, 2, HASH, recent, POLICY, later).state == "Restarting"
    exhausted = formed(recent_restarts=POLICY["maxGroupRestarts"], total_restarts=9)
    decision = group.decide(pods, 2, HASH, exhausted, POLICY, NOW)
    assert decision.state == "Exhausted" and not decision.delete
    assert "maxGroupRestarts=5" in decision.message


def test_backoff_is_capped() -> None:
    assert group.backoff_seconds(POLICY, 0) == 0
    assert group.backoff_seconds(POLICY, 1) == 10
    assert group.backoff_seconds(POLICY, 3) == 40
    assert group.backoff_seconds(POLICY, 30) == POLICY["maxBackoffSeconds"]


def test_stale_config_rolls_without_counting() -> None:
    pods = [pod("d-worker-0", "a", config_hash="old"), pod("d-worker-1", "b", config_hash="old")]
    decision = group.decide(pods, 2, HASH, formed(recent_restarts=3), POLICY, NOW)
    assert decision.state == "Rolling" and not decision.counted
    assert len(decision.delete) == 2 and decision.memory.recent_restarts == 0


def test_available_group_clears_recent_restarts_after_reset_window() -> None:
    pods = [pod("d-worker-0", "a"), pod("d-worker-1", "b")]
    window = dt.timedelta(seconds=POLICY["resetAfterSeconds"])
    long_formed = NOW - window - dt.timedelta(hours=1)
    memory = group.Memory(
        members=formed().members, recent_restarts=2, formed_at=long_formed, available_since=NOW - window
    )
    assert group.decide(pods, 2, HASH, memory, POLICY, NOW).memory.recent_restarts == 0
    # Formed long ago but Available only recently, or never: the count stays.
    recent = replace(memory, available_since=NOW - window + dt.timedelta(seconds=1))
    assert group.decide(pods, 2, HASH, recent, POLICY, NOW).memory.recent_restarts == 2
    never = replace(memory, available_since=None)
    assert group.decide(pods, 2, HASH, never, POLICY, NOW).memory.recent_restarts == 2


def test_available_since_is_kept_in_the_group_entry() -> None:
    assert group.Memory.from_status(
        {"availableSince": "2026-01-01T11:00:00Z"}
    ).available_since == NOW - dt.timedelta(hours=1)
    assert group.Memory.from_status({}).available_since is None
    # status writes it when the group becomes Available and keeps it while the group stays so
    spec = specs.with_defaults({"branchParallelism": 1})
    pods = [pod("d-0-worker-0", "a"), pod("d-0-master-x", "m", role="master")]
    decision = group.decide(pods[:1], 1, HASH, group.Memory(), POLICY, NOW)
    first = derive(_cr(), spec, pods, decision, NOW)
    assert first["groups"][0]["availableSince"] == "2026-01-01T12:00:00Z"
    later = derive({**_cr(), "status": first}, spec, pods, decision, NOW + dt.timedelta(minutes=5))
    assert later["groups"][0]["availableSince"] == "2026-01-01T12:00:00Z"
    down = [pods[0], pod("d-0-master-x", "m", role="master", ready=False)]
    assert "availableSince" not in derive({**_cr(), "status": later}, spec, down, decision, NOW)["groups"][0]


def derive(cr: dict, spec: dict, pods: list[dict], decision: group.Decision, now: dt.datetime) -> dict:
    """status.derive of a deployment with one group (index 0) made of `pods`."""
    wanted = spec["branchParallelism"]
    return status.derive(cr, spec, [status.GroupRound(0, pods, HASH, wanted, decision)], HASH, now)


def _cycle(
    memory: group.Memory, pods: list[dict], now: dt.datetime, policy: dict, serving: bool
) -> group.Decision:
    """One reconcile as reconcile.py runs it: decide, derive status, remember what status says."""
    spec = specs.with_defaults({"branchParallelism": 2, "failurePolicy": policy})
    masters = [pod("d-master-x", "m", role="master", ready=serving)]
    decision = group.decide(pods, 2, HASH, memory, policy, now)
    st = derive({**_cr(), "status": _STATUS[0]}, spec, pods + masters, decision, now)
    _STATUS[0] = st
    return replace(decision, memory=group.Memory.from_status(st["groups"][0]))


_STATUS: list[dict] = [{}]


def test_group_that_never_becomes_available_reaches_degraded() -> None:
    # A rank that never joins: every pod runs, the master never serves, and the worker exits
    # at its join timeout (600 s); resetAfterSeconds is as long. The restarts must count up to
    # Degraded, not restart forever with the count stuck at 1 (a window started when the pods ran).
    policy = {**POLICY, "resetAfterSeconds": 600, "maxGroupRestarts": 3}
    _STATUS[0] = {}
    memory, now, states = group.Memory(), NOW, []
    for uid in range(12):
        pods = [pod("d-worker-0", f"a{uid}"), pod("d-worker-1", f"b{uid}")]
        formed_now = _cycle(memory, pods, now, policy, serving=False)
        assert formed_now.state == "Formed"
        # still running and not serving after the window (the old reset point)
        waited = _cycle(formed_now.memory, pods, now + dt.timedelta(seconds=600), policy, serving=False)
        assert waited.memory.recent_restarts == memory.recent_restarts
        pods[1] = pod("d-worker-1", f"b{uid}", restarts=1)  # rank 1 gave up joining
        now += dt.timedelta(seconds=610)
        decision = _cycle(waited.memory, pods, now, policy, serving=False)
        states.append(decision.state)
        memory = decision.memory
        if decision.state == "Exhausted":
            break
        assert decision.state == "Restarting"
        now += dt.timedelta(seconds=group.backoff_seconds(policy, memory.recent_restarts) + 1)
    assert states == ["Restarting"] * 3 + ["Exhausted"]
    assert memory.recent_restarts == 3 and memory.total_restarts == 3


def test_group_available_for_the_window_resets_the_count() -> None:
    policy = {**POLICY, "resetAfterSeconds": 600}
    _STATUS[0] = {}
    pods = [pod("d-worker-0", "a"), pod("d-worker-1", "b")]
    memory = group.Memory(recent_restarts=2, total_restarts=2, last_restart=NOW - dt.timedelta(seconds=60))
    formed_now = _cycle(memory, pods, NOW, policy, serving=True)  # forms and is Available at NOW
    assert formed_now.memory.available_since == NOW
    almost = _cycle(formed_now.memory, pods, NOW + dt.timedelta(seconds=599), policy, serving=True)
    assert almost.memory.recent_restarts == 2
    done = _cycle(almost.memory, pods, NOW + dt.timedelta(seconds=600), policy, serving=True)
    assert done.memory.recent_restarts == 0 and done.memory.total_restarts == 2


def test_terminating_pods_are_ignored() -> None:
    pods = [pod("d-worker-0", "a", deleting=True), pod("d-worker-1", "b", deleting=True)]
    assert group.decide(pods, 2, HASH, group.Memory(), POLICY, NOW).state == "Forming"


def test_memory_round_trips_through_status() -> None:
    memory = formed(total_restarts=3, recent_restarts=1, last_restart=NOW)
    assert group.Memory.from_status(memory.to_status()) == memory


def _cr(generation: int = 1) -> dict:
    return {"metadata": {"name": "d", "namespace": "ns", "generation": generation}, "status": {}}


def _conditions(st: dict) -> dict[str, dict]:
    return {c["type"]: c for c in st["conditions"]}


def test_status_available_when_group_and_master_ready() -> None:
    spec = specs.with_defaults({"branchParallelism": 2})
    pods = [pod("d-worker-0", "a"), pod("d-worker-1", "b"), pod("d-master-x", "m", role="master")]
    decision = group.decide(pods[:2], 2, HASH, group.Memory(), POLICY, NOW)
    st = derive(_cr(3), spec, pods, decision, NOW)
    cond = _conditions(st)
    assert st["phase"] == "Available" and st["ready"] == "1/1" and st["observedGeneration"] == 3
    assert st["readyWorkers"] == st["workers"] == 2 and st["readyReplicas"] == st["replicas"] == 1
    assert st["groups"][0]["ready"] == "2/2" and st["groups"][0]["available"] is True
    assert cond["Available"]["status"] == "True" and cond["CollectiveReady"]["status"] == "True"
    assert cond["Progressing"]["status"] == "False" and cond["Degraded"]["status"] == "False"
    assert st["endpoint"] == "d.ns.svc:50051"
    assert set(cond) == set(status.CONDITION_TYPES)


def test_status_names_missing_resource_when_unschedulable() -> None:
    spec = specs.with_defaults({"branchParallelism": 2, "accelerator": {"type": "nvidia"}})
    message = "0/6 nodes are available: 2 Insufficient nvidia.com/gpu, 4 node(s) didn't match selector."
    pods = [pod("d-worker-0", "a", unschedulable=message), pod("d-worker-1", "b", unschedulable=message)]
    decision = group.decide(pods, 2, HASH, group.Memory(), POLICY, NOW)
    st = derive(_cr(), spec, pods, decision, NOW)
    sched = _conditions(st)["Schedulable"]
    assert sched["status"] == "False" and sched["reason"] == "InsufficientResources"
    assert sched["message"].startswith("Insufficient nvidia.com/gpu")
    assert st["phase"] == "Pending"
    # With several groups the message names the stuck one, as every other condition's does.
    serving = [pod("d-1-worker-0", "c"), pod("d-1-worker-1", "d")]
    two = specs.with_defaults({"replicas": 2, "branchParallelism": 2, "accelerator": {"type": "nvidia"}})
    settled = group.decide(serving, 2, HASH, group.Memory(), POLICY, NOW)
    rounds = [status.GroupRound(0, serving, HASH, 2, settled), status.GroupRound(1, pods, HASH, 2, decision)]
    sched = _conditions(status.derive(_cr(), two, rounds, HASH, NOW))["Schedulable"]
    assert sched["status"] == "False" and sched["message"].startswith("group 1: Insufficient nvidia.com/gpu")


def test_status_degraded_when_restarts_exhausted() -> None:
    spec = specs.with_defaults({"branchParallelism": 2})
    pods = [pod("d-worker-0", "a"), pod("d-worker-1", "b2")]
    decision = group.decide(pods, 2, HASH, formed(recent_restarts=5), POLICY, NOW)
    st = derive(_cr(), spec, pods, decision, NOW)
    assert st["phase"] == "Degraded" and _conditions(st)["Degraded"]["status"] == "True"
    assert _conditions(st)["Available"]["status"] == "False"


def test_transition_time_kept_while_status_unchanged() -> None:
    spec = specs.with_defaults({"branchParallelism": 1})
    pods = [pod("d-worker-0", "a")]
    decision = group.decide(pods, 1, HASH, group.Memory(), POLICY, NOW)
    first = derive(_cr(), spec, pods, decision, NOW)
    cr = {**_cr(), "status": first}
    later = derive(cr, spec, pods, decision, NOW + dt.timedelta(minutes=5))
    assert (
        _conditions(later)["Available"]["lastTransitionTime"]
        == _conditions(first)["Available"]["lastTransitionTime"]
    )


def test_a_failed_workers_exit_reason_is_in_the_message() -> None:
    """A failed worker's exit reason (OOMKilled, the exit code, its log's last line) reaches the
    condition message and the event."""
    crashed = pod("d-worker-1", "b", restarts=1)
    crashed["status"]["containerStatuses"][0]["lastState"] = {
        "terminated": {"reason": "OOMKilled", "exitCode": 137}
    }
    d = group.decide([pod("d-worker-0", "a"), crashed], 2, HASH, formed(), POLICY, NOW)
    assert d.state == "Restarting"
    assert d.message.startswith("worker pod d-worker-1 restarted (OOMKilled, exit code 137); recreating")
    failed = pod("d-worker-0", "a", phase="Failed")
    failed["status"]["containerStatuses"][0]["state"] = {"terminated": {"reason": "Error", "exitCode": 3}}
    d = group.decide([failed, pod("d-worker-1", "b")], 2, HASH, formed(), POLICY, NOW)
    assert d.message.startswith("worker pod d-worker-0 failed (Error, exit code 3)")
    # The log's last line (terminationMessagePolicy FallbackToLogsOnError) says why the process stopped.
    said = "lopa worker: error: /etc/lopa/lopa.yaml: limits.max_step_tokens: 4 tokens cannot hold one"
    failed["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = f"loading\n{said}\n\n"
    d = group.decide([failed, pod("d-worker-1", "b")], 2, HASH, formed(), POLICY, NOW)
    assert d.message.startswith(f"worker pod d-worker-0 failed (Error, exit code 3: {said})")
    failed["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = "x" * 5000
    d = group.decide([failed, pod("d-worker-1", "b")], 2, HASH, formed(), POLICY, NOW)
    assert f"exit code 3: {'x' * 297}...)" in d.message


def test_every_container_leaves_its_logs_tail_as_its_termination_message() -> None:
    from lopa_operator import pods

    spec = specs.with_defaults({"branchParallelism": 2})
    for template in (pods.worker_template("d", spec, HASH, 0), pods.master_template("d", spec, HASH, 0)):
        (container,) = template["spec"]["containers"]
        assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_the_restart_trigger_rolls_the_group_only_when_set_or_changed() -> None:
    from lopa_operator import render

    base = specs.with_defaults({})
    untouched = render.group_hash("d", "ns", base)
    assert render.group_hash("d", "ns", {**base, "restartTrigger": ""}) == untouched
    first = render.group_hash("d", "ns", {**base, "restartTrigger": "2026-11-23T10:00"})
    second = render.group_hash("d", "ns", {**base, "restartTrigger": "2026-11-23T11:00"})
    assert len({untouched, first, second}) == 3
    # A new hash makes every pod stale: the group rolls and its consecutive restarts start over.
    exhausted = formed(recent_restarts=POLICY["maxGroupRestarts"])
    d = group.decide([pod("d-worker-0", "a"), pod("d-worker-1", "b")], 2, first, exhausted, POLICY, NOW)
    assert d.state == "Rolling" and len(d.delete) == 2 and d.memory.recent_restarts == 0
