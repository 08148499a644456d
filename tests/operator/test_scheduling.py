"""Gang scheduling with the Workload API and topology placement, on the real kube-scheduler.

The module adds kwok nodes of its own that advertise a fake GPU resource no other node has (so the
capacity is exactly what the test says, whatever the other modules run): two nodes of 4 for the
gang tests, two zones of two nodes of 2 for the topology tests. A group that needs more GPUs than
are free stays wholly Pending with the gang (spec.scheduling.gang: Workload; PodGroup, GangScheduling
plugin) and is half placed without it; freeing capacity binds the whole waiting group.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from lopa_op_helpers import condition, is_available, lopa, pods, wait_status

from kube.cluster import KubeCluster
from kube.nodes import FakeNode

GANG_GPU = "test.lopa.dev/gang-gpu"
ZONE_GPU = "test.lopa.dev/zone-gpu"
ZONE = "topology.kubernetes.io/zone"


def node(name: str, resource: str, count: int, labels: dict[str, str] | None = None) -> FakeNode:
    capacity = {"cpu": "32", "memory": "128Gi", "pods": "110", resource: str(count)}
    return FakeNode(name, labels or {}, capacity, {resource: count})


NODES = [
    node("kwok-gang-0", GANG_GPU, 4), node("kwok-gang-1", GANG_GPU, 4),
    *(node(f"kwok-zone-{z}-{i}", ZONE_GPU, 2, {ZONE: f"zone-{z}"}) for z in "ab" for i in range(2)),
]


@pytest.fixture(scope="module", autouse=True)
def gpu_nodes(kube: KubeCluster) -> Iterator[None]:
    kube.apply([n.manifest() for n in NODES])

    def ready() -> bool:
        listed = {n["metadata"]["name"]: n for n in kube.get_json("nodes")["items"]}
        return all(any(c["type"] == "Ready" and c["status"] == "True"
                       for c in listed.get(n.name, {}).get("status", {}).get("conditions", []))
                   for n in NODES)

    kube.wait_for(ready, timeout=60, description="the test's GPU nodes Ready")
    try:
        yield
    finally:
        kube.kubectl("delete", "node", *[n.name for n in NODES], "--wait=false", check=False)


def deploy(kube: KubeCluster, ns: str, name: str, workers: int, resource: str, **spec: Any) -> None:
    kube.apply({
        "apiVersion": "lopa.dev/v1alpha1", "kind": "LoPADeployment", "metadata": {"name": name},
        "spec": {"accelerator": {"type": "nvidia", "resourceName": resource}, "branchParallelism": workers,
                 **spec},
    }, namespace=ns)


def bound(kube: KubeCluster, ns: str, name: str) -> dict[str, list[str]]:
    """The nodes each role's pods are bound to (unbound pods left out)."""
    return {role: [p["spec"]["nodeName"] for p in pods(kube, ns, name, role) if p["spec"].get("nodeName")]
            for role in ("worker", "master")}


def available(kube: KubeCluster, ns: str, name: str) -> dict[str, Any]:
    return wait_status(kube, ns, name, is_available, timeout=90, description=f"{name} Available")


def unschedulable(kube: KubeCluster, ns: str, name: str, words: str) -> dict[str, Any]:
    def stuck(o: dict[str, Any]) -> bool:
        c = condition(o, "Schedulable")
        return c.get("status") == "False" and words in c.get("message", "")

    return wait_status(kube, ns, name, stuck, timeout=60, description=f"{name} Schedulable=False")


def test_without_a_gang_a_group_is_half_placed(kube: KubeCluster, ns: str) -> None:
    deploy(kube, ns, "first", 6, GANG_GPU)
    available(kube, ns, "first")
    deploy(kube, ns, "second", 4, GANG_GPU)  # 4 GPUs wanted, 2 free
    final = unschedulable(kube, ns, "second", f"Insufficient {GANG_GPU}")
    kube.wait_for(lambda: len(bound(kube, ns, "second")["worker"]) == 2, timeout=30,
                  description="two of second's workers bound")
    # What the gang prevents: two GPUs held by a group that cannot serve, and its master running.
    assert len(bound(kube, ns, "second")["master"]) == 1
    assert final["status"]["phase"] == "Pending"


def test_a_gang_waits_whole_until_it_fits_then_binds_whole(kube: KubeCluster, ns: str) -> None:
    gang = {"scheduling": {"gang": "Workload"}}
    deploy(kube, ns, "first", 6, GANG_GPU, **gang)
    first = available(kube, ns, "first")
    assert len(bound(kube, ns, "first")["worker"]) == 6
    assert kube.get_json("podgroup", "first-0", "-n", ns)["spec"]["schedulingPolicy"]["gang"]["minCount"] == 7
    assert first["status"]["groups"][0]["available"] is True

    deploy(kube, ns, "second", 4, GANG_GPU, **gang)  # 4 GPUs wanted, 2 free: none of its 5 pods binds
    final = unschedulable(kube, ns, "second", f"Insufficient {GANG_GPU}")
    sched = condition(final, "Schedulable")
    assert sched["reason"] == "InsufficientResources"
    assert sched["message"].startswith(f"Insufficient {GANG_GPU}: the group's pods are bound together")
    assert final["status"]["phase"] == "Pending"
    for _ in range(10):  # and it stays so: not one pod bound, the master neither
        assert bound(kube, ns, "second") == {"worker": [], "master": []}
        time.sleep(0.5)
    assert len(pods(kube, ns, "second")) == 4  # the pods exist: the scheduler holds them

    kube.kubectl("delete", "lopadeployment", "first", "-n", ns)  # frees 6 GPUs
    after = available(kube, ns, "second")
    placed = bound(kube, ns, "second")
    assert len(placed["worker"]) == 4 and len(placed["master"]) == 1
    assert condition(after, "Schedulable")["status"] == "True"


def test_a_required_zone_places_the_workers_in_one_zone(kube: KubeCluster, ns: str) -> None:
    zone_of = {n.name: n.labels[ZONE] for n in NODES if ZONE in n.labels}
    deploy(kube, ns, "zoned", 4, ZONE_GPU, placement={"sameNode": "None", "topology": {"key": ZONE}})
    available(kube, ns, "zoned")
    placed = bound(kube, ns, "zoned")["worker"]
    # 4 workers, 2 GPUs a node: two nodes, both of one zone
    assert len(placed) == 4 and len(set(placed)) == 2 and len({zone_of[n] for n in placed}) == 1, placed
    kube.kubectl("delete", "lopadeployment", "zoned", "-n", ns)
    kube.wait_for(lambda: not pods(kube, ns, "zoned"), timeout=60, description="zoned's pods gone")

    # 6 workers: 8 GPUs free, but no zone has 6
    deploy(kube, ns, "too-wide", 6, ZONE_GPU, placement={"sameNode": "None", "topology": {"key": ZONE}})
    final = unschedulable(kube, ns, "too-wide", "domain")
    sched = condition(final, "Schedulable")
    assert sched["reason"] == "GroupDoesNotFitOneDomain", sched
    assert sched["message"].startswith(f"the group's workers must share one {ZONE} domain"), sched
    placed = bound(kube, ns, "too-wide")["worker"]
    assert len(placed) == 4 and len({zone_of[n] for n in placed}) == 1, placed
    assert lopa(kube, ns, "too-wide")["status"]["phase"] == "Pending"


def test_a_gang_with_a_required_zone_that_fits_nowhere_binds_nothing(kube: KubeCluster, ns: str) -> None:
    spec = {"placement": {"sameNode": "None", "topology": {"key": ZONE}}, "scheduling": {"gang": "Workload"}}
    deploy(kube, ns, "wide-gang", 6, ZONE_GPU, **spec)

    def stuck(o: dict[str, Any]) -> bool:
        return condition(o, "Schedulable").get("status") == "False"

    wait_status(kube, ns, "wide-gang", stuck, timeout=60, description="wide-gang Schedulable=False")
    for _ in range(6):
        assert bound(kube, ns, "wide-gang") == {"worker": [], "master": []}
        time.sleep(0.5)
