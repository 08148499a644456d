"""spec.scheduling (gang.py) without a cluster: what each mode renders, what the status says of a
group a gang holds, and a cluster that lacks what the mode needs (tests/operator/test_scheduling.py
and test_kueue.py run the same against the real scheduler and Kueue)."""

from __future__ import annotations

import logging
from typing import Any

from fake_kube import FakeKube

from lopa_operator import gang, names, reconcile, render, status
from lopa_operator import spec as specs
from lopa_operator.kube import KubeError, path
from lopa_operator.ownership import spec_error


def by_kind(spec: dict[str, Any], name: str = "d") -> dict[str, dict[str, Any]]:
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in render.children(name, "ns", spec)}


def pod_spec(objs: dict[str, dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return objs[f"{kind}/{name}"]["spec"]["template"]


def test_none_renders_no_gang() -> None:
    objs = by_kind({"branchParallelism": 2})
    assert not [k for k in objs if k.startswith(("Workload/", "PodGroup/"))]
    worker = pod_spec(objs, "StatefulSet", "d-0-worker")
    assert "schedulingGroup" not in worker["spec"] and "priorityClassName" not in worker["spec"]
    assert not [k for k in worker["metadata"]["labels"] if k.startswith("kueue.x-k8s.io/")]


def test_workload_renders_a_podgroup_per_group_that_every_pod_names() -> None:
    spec = {"replicas": 2, "branchParallelism": 3, "scheduling": {"gang": "Workload"}}
    children = render.children("d", "ns", spec)
    kinds = [f"{o['kind']}/{o['metadata']['name']}" for o in children]
    objs = {k: o for k, o in zip(kinds, children, strict=True)}
    workload = objs["Workload/d"]
    assert workload["apiVersion"] == "scheduling.k8s.io/v1beta1"
    owner = {"apiGroup": "lopa.dev", "kind": "LoPADeployment", "name": "d"}
    assert workload["spec"]["controllerRef"] == owner
    assert workload["spec"]["podGroupTemplates"] == [
        {"name": "group", "schedulingPolicy": {"gang": {"minCount": 4}}}]
    for index in range(2):
        group = objs[f"PodGroup/d-{index}"]
        # every pod of the group: its 3 workers and its master
        assert group["spec"]["schedulingPolicy"] == {"gang": {"minCount": 4}}
        assert group["spec"]["workloadRef"] == {"workloadName": "d", "templateName": "group"}
        assert group["metadata"]["labels"][names.GROUP_LABEL] == str(index)
        # made before the pods that name it
        assert kinds.index(f"PodGroup/d-{index}") < kinds.index(f"StatefulSet/d-{index}-worker")
        for kind, owner in (("StatefulSet", f"d-{index}-worker"), ("Deployment", f"d-{index}-master")):
            assert pod_spec(objs, kind, owner)["spec"]["schedulingGroup"] == {"podGroupName": f"d-{index}"}


def test_a_priority_class_goes_on_pods_and_names_a_new_podgroup() -> None:
    spec = {"scheduling": {"gang": "Workload", "priorityClassName": "inference-high"}}
    objs = by_kind(spec)
    (group,) = [o for k, o in objs.items() if k.startswith("PodGroup/")]
    # A PodGroup's priority class is immutable: another class, another PodGroup (pods roll to it).
    assert group["metadata"]["name"].startswith("d-0-") and group["metadata"]["name"] != "d-0"
    assert group["spec"]["priorityClassName"] == "inference-high"
    worker = pod_spec(objs, "StatefulSet", "d-0-worker")["spec"]
    assert worker["priorityClassName"] == "inference-high"
    assert worker["schedulingGroup"]["podGroupName"] == group["metadata"]["name"]
    other = {"scheduling": {"gang": "Workload", "priorityClassName": "batch"}}
    assert gang.pod_group_name("d", 0, other) != group["metadata"]["name"]
    plain = by_kind({"scheduling": {"priorityClassName": "batch"}})
    assert pod_spec(plain, "Deployment", "d-0-master")["spec"]["priorityClassName"] == "batch"


def test_kueue_queues_the_worker_statefulsets_and_holds_the_master_until_admitted() -> None:
    spec = {"branchParallelism": 2, "replicas": 2, "scheduling": {"gang": "Kueue", "queueName": "gpus"}}
    objs = by_kind(spec)
    assert not [k for k in objs if k.startswith(("Workload/", "PodGroup/"))]
    for index in range(2):
        # Kueue's StatefulSet integration makes the workers one serving pod group of the queue.
        queued = objs[f"StatefulSet/d-{index}-worker"]["metadata"]["labels"]
        assert queued["kueue.x-k8s.io/queue-name"] == "gpus"
        master = objs[f"Deployment/d-{index}-master"]
        assert "kueue.x-k8s.io/queue-name" not in master["metadata"]["labels"]  # the master is not queued
    full = specs.with_defaults(spec)
    worker = {"metadata": {"name": "w", "labels": {}}, "spec": {}}
    waiting = {"metadata": {"name": "w", "labels": {}},
               "spec": {"schedulingGates": [{"name": gang.KUEUE_GATE}]}}
    released = {"spec": {"replicas": 1}}
    assert gang.hold_master(full, None, [])  # no worker yet
    assert gang.hold_master(full, None, [worker, waiting])  # one still behind the gate
    assert not gang.hold_master(full, None, [worker, worker])  # admitted: the master is made
    # Once released it stays, though a group restart gates new workers again.
    assert not gang.hold_master(full, released, [waiting, waiting])
    assert not gang.hold_master(specs.with_defaults({}), None, [])
    held = {f"{o['kind']}/{o['metadata']['name']}": o
            for o in render.group_children("d", "ns", spec, 0, hold_master=True)}
    assert held["Deployment/d-0-master"]["spec"]["replicas"] == 0


def test_stale_podgroups_go_once_no_pod_names_them() -> None:
    listed = [{"metadata": {"name": n}} for n in ("d-0", "d-0-abc123", "d-1")]
    running = [{"spec": {"schedulingGroup": {"podGroupName": "d-0"}}}]
    assert gang.stale_pod_groups(listed, {"d-0-abc123", "d-1"}, running) == []
    assert gang.stale_pod_groups(listed, {"d-0-abc123", "d-1"}, []) == ["d-0"]


def gated(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": name, "labels": {}, "annotations": {}},
            "spec": {"schedulingGates": [{"name": gang.KUEUE_GATE}]},
            "status": {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"}]}}


def unschedulable(name: str, message: str, group: str = "") -> dict[str, Any]:
    spec = {"schedulingGroup": {"podGroupName": group}} if group else {}
    return {"metadata": {"name": name, "uid": name, "labels": {}, "annotations": {}}, "spec": spec,
            "status": {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}]}}


def test_a_group_kueue_holds_is_reported_with_kueues_reason() -> None:
    quota = ("couldn't assign flavors to pod set worker: insufficient unused quota for test.lopa.dev/gpu "
             "in flavor gpus, 2 more needed")
    reason, message = status.scheduling_problem([gated("d-0-worker-0"), gated("d-0-worker-1")], quota)
    assert reason == "WaitingForQuota"
    assert message.startswith("Kueue admits the group's 2 waiting pod(s) only together") and quota in message
    # Without Kueue's Workload to read (no permission, not yet made) the gate itself is reported.
    assert "admission gate" in status.scheduling_problem([gated("p")])[1]  # type: ignore[index]


def test_a_gang_the_scheduler_cannot_place_names_the_missing_resource() -> None:
    gang_says = "pod group is unschedulable, minCount (4) cannot be satisfied: 2 scheduled, 0 remaining"
    short = "0/8 nodes are available: 2 Insufficient test.lopa.dev/gpu."
    pods = [unschedulable("d-0-worker-0", gang_says, "d-0"), unschedulable("d-0-worker-1", short, "d-0"),
            unschedulable("d-0-master-x", gang_says, "d-0")]
    reason, message = status.scheduling_problem(pods)  # type: ignore[misc]
    assert reason == "InsufficientResources"
    assert message.startswith(
        "Insufficient test.lopa.dev/gpu: the group's pods are bound together or not at all")
    assert "3 pod(s) cannot be scheduled; d-0-worker-1: 0/8 nodes are available" in message


def test_a_cluster_without_the_workload_api_is_told_so() -> None:
    missing = KubeError(404, "the server could not find the requested resource")
    error = gang.explain(missing, {"kind": "PodGroup"})
    assert spec_error(error) and "GenericWorkload feature gate" in error.message
    assert gang.explain(missing, {"kind": "ConfigMap"}) is missing and not spec_error(missing)


def reconciled(fake: FakeKube) -> dict[str, Any]:
    out = reconcile.reconcile(fake, "ns", "d", "test", lambda *a: None, logging.getLogger("t"), fake.memo)  # type: ignore[arg-type]
    assert out is not None
    fake.patch_status("ns", "d", out)
    return out


def test_kueue_without_the_local_queue_creates_no_group() -> None:
    fake = FakeKube.with_deployment({"scheduling": {"gang": "Kueue", "queueName": "gpus"}})
    out = reconciled(fake)
    cond = {c["type"]: c for c in out["conditions"]}["Reconciled"]
    assert cond["status"] == "False" and "LocalQueue ns/gpus not found" in cond["message"]
    assert not fake.of_kind("StatefulSet")  # never placed without the gang it asked for
    fake.objects[path("LocalQueue", "ns", "gpus")] = {"metadata": {"name": "gpus"}}
    fake.memo.clear()
    reconciled(fake)
    assert "d-0-worker" in fake.of_kind("StatefulSet")


def test_turning_the_workload_gang_off_removes_its_objects() -> None:
    fake = FakeKube.with_deployment({"scheduling": {"gang": "Workload"}})
    reconciled(fake)
    assert "d" in fake.of_kind("Workload") and "d-0" in fake.of_kind("PodGroup")
    fake.objects[path(names.KIND, "ns", "d")]["spec"] = {}
    reconciled(fake)
    assert not fake.of_kind("Workload") and not fake.of_kind("PodGroup")
    assert specs.with_defaults({})["scheduling"] == {"gang": "None"}
