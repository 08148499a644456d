"""Gang scheduling with Kueue (spec.scheduling.gang: Kueue), the real Kueue v0.17.0 controller and
webhooks (tests/kube/kueue.py) beside the real scheduler.

Two kwok nodes of 4 fake GPUs (a resource only they have) and a ClusterQueue with a quota of those
8: a group's workers are admitted, released and bound only when the quota holds all of them, and
its master made only then; a group that does not fit waits with every worker behind Kueue's gate
and no master (not one pod bound) and a status that quotes Kueue's reason, and is admitted whole
once capacity frees. A group restart (a lost worker) and a roll re-form under Kueue, and a
LocalQueue that does not exist creates no group at all.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from lopa_op_helpers import OperatorProcess, condition, is_available, lopa, pods, wait_status

from kube.cluster import KubeCluster
from kube.kueue import NAMESPACE_LABEL, Kueue, unavailable
from kube.nodes import FakeNode

GPU = "test.lopa.dev/kueue-gpu"
NODES = [FakeNode(f"kwok-kueue-{i}", {}, {"cpu": "32", "memory": "128Gi", "pods": "110", GPU: "4"}, {GPU: 4})
         for i in range(2)]


@pytest.fixture(scope="module")
def kueue(kube: KubeCluster) -> Iterator[Kueue]:
    why = unavailable()
    if why:
        pytest.skip(f"Kueue {why}")
    kube.apply([n.manifest() for n in NODES])
    controller = Kueue(kube).start()
    try:
        yield controller
    finally:
        print(f"--- kueue log (tail) ---\n{controller.logs()}")
        controller.stop()
        kube.kubectl("delete", "node", *[n.name for n in NODES], "--wait=false", check=False)


@pytest.fixture
def queue(kube: KubeCluster, kueue: Kueue, ns: str) -> Iterator[str]:
    """LocalQueue `gpus` of `ns`, on a ClusterQueue holding the 8 GPUs."""
    kube.kubectl("label", "namespace", ns, f"{NAMESPACE_LABEL}=true")
    flavor, cluster_queue = "lopa-test-gpus", f"lopa-test-{ns}"
    kube.apply([
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": flavor}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": cluster_queue},
         "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
                  "resourceGroups": [{"coveredResources": [GPU], "flavors": [
                      {"name": flavor, "resources": [{"name": GPU, "nominalQuota": 8}]}]}]}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
         "metadata": {"name": "gpus", "namespace": ns}, "spec": {"clusterQueue": cluster_queue}},
    ])
    try:
        yield "gpus"
    finally:
        kube.kubectl("delete", "clusterqueue", cluster_queue, "--wait=false", check=False)


def deploy(kube: KubeCluster, ns: str, name: str, workers: int, queue: str) -> None:
    kube.apply({
        "apiVersion": "lopa.dev/v1alpha1", "kind": "LoPADeployment", "metadata": {"name": name},
        "spec": {"accelerator": {"type": "nvidia", "resourceName": GPU}, "branchParallelism": workers,
                 "scheduling": {"gang": "Kueue", "queueName": queue}},
    }, namespace=ns)


def group_pods(kube: KubeCluster, ns: str, name: str) -> list[dict[str, Any]]:
    return pods(kube, ns, name) + pods(kube, ns, name, "master")


def bound(kube: KubeCluster, ns: str, name: str) -> list[str]:
    return [p["metadata"]["name"] for p in group_pods(kube, ns, name) if p["spec"].get("nodeName")]


def available(kube: KubeCluster, ns: str, name: str, kueue: Kueue) -> dict[str, Any]:
    try:
        return wait_status(kube, ns, name, is_available, timeout=120, description=f"{name} Available")
    except TimeoutError as error:
        raise TimeoutError(f"{error}\n--- kueue ---\n{kueue.logs(30)}") from None


def test_a_group_is_admitted_whole_or_waits_whole_behind_the_gate(
    kube: KubeCluster, kueue: Kueue, queue: str, ns: str, operator: OperatorProcess
) -> None:
    deploy(kube, ns, "first", 6, queue)
    available(kube, ns, "first", kueue)
    assert len(bound(kube, ns, "first")) == 7  # 6 workers and the master
    (group,) = {p["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] for p in pods(kube, ns, "first")}
    workload = kube.get_json("workloads.kueue.x-k8s.io", group, "-n", ns)
    assert condition(workload, "Admitted").get("status") == "True"

    deploy(kube, ns, "second", 4, queue)  # 4 GPUs wanted, 2 left in the quota

    def waiting(o: dict[str, Any]) -> bool:
        c = condition(o, "Schedulable")
        return c.get("reason") == "WaitingForQuota" and GPU in c.get("message", "")

    final = wait_status(kube, ns, "second", waiting, timeout=60, description="second waiting for quota")
    sched = condition(final, "Schedulable")
    assert sched["status"] == "False" and sched["message"].startswith(
        "Kueue admits the group's 4 waiting pod(s) only together"), sched
    assert f"insufficient unused quota for {GPU}" in sched["message"], sched
    assert final["status"]["phase"] == "Pending"
    for _ in range(6):
        second = group_pods(kube, ns, "second")
        assert len(second) == 4 and not bound(kube, ns, "second")  # 4 gated workers, no master yet
        for p in second:  # each behind Kueue's admission gate (beside its topology gate)
            assert "kueue.x-k8s.io/admission" in [g["name"] for g in p["spec"]["schedulingGates"]]
        time.sleep(0.5)
    assert kube.get_json("deployment", "second-0-master", "-n", ns)["spec"]["replicas"] == 0

    # Deleted, its StatefulSet and pods go and Kueue releases their quota.
    kube.kubectl("delete", "lopadeployment", "first", "-n", ns)
    available(kube, ns, "second", kueue)
    kube.wait_for(lambda: not group_pods(kube, ns, "first"), timeout=60, description="first's pods gone")
    assert len(bound(kube, ns, "second")) == 5
    assert operator.forbidden_lines() == []  # the chart's RBAC reads Kueue's queue and workload


def test_a_restarted_or_rolled_group_reforms_under_kueue(
    kube: KubeCluster, kueue: Kueue, queue: str, ns: str
) -> None:
    deploy(kube, ns, "restart", 3, queue)
    before = available(kube, ns, "restart", kueue)
    old = {p["metadata"]["uid"] for p in pods(kube, ns, "restart")}
    kube.kubectl("delete", "pod", "restart-0-worker-1", "-n", ns, "--wait=false")

    def reformed(o: dict[str, Any]) -> bool:
        return is_available(o) and o["status"]["groupRestarts"] > before["status"]["groupRestarts"]

    after = wait_status(kube, ns, "restart", reformed, timeout=120, description="the group re-formed")
    new = {p["metadata"]["uid"] for p in pods(kube, ns, "restart")}
    assert len(new) == 3 and not new & old  # every worker recreated, released by Kueue again

    # A spec change rolls every pod of the group (its master too): the new ones join the workload.
    kube.kubectl("patch", "lopadeployment", "restart", "-n", ns, "--type=merge",
                 "-p", '{"spec": {"decoding": {"branches": 2}}}')

    def rolled(o: dict[str, Any]) -> bool:
        return is_available(o) and o["status"]["configHash"] != after["status"]["configHash"]

    wait_status(kube, ns, "restart", rolled, timeout=120, description="the rolled group Available")
    assert not {p["metadata"]["uid"] for p in pods(kube, ns, "restart")} & new


def test_a_missing_local_queue_creates_no_group(kube: KubeCluster, kueue: Kueue, ns: str) -> None:
    deploy(kube, ns, "unqueued", 2, "no-such-queue")

    def refused(o: dict[str, Any]) -> bool:
        return condition(o, "Reconciled").get("status") == "False"

    final = wait_status(kube, ns, "unqueued", refused, timeout=60, description="Reconciled=False")
    message = condition(final, "Reconciled")["message"]
    assert f"LocalQueue {ns}/no-such-queue not found" in message, message
    assert kube.get_json("statefulsets", "-n", ns)["items"] == []
    assert lopa(kube, ns, "unqueued")["status"].get("phase") != "Available"
