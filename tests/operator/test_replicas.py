"""Replicas of groups on the real control plane: scale subresource, HPA, per-group
restarts and group-at-a-time rollouts. kwok plays the kubelets (pods turn Ready without running).
"""

from __future__ import annotations

import json
import threading
from typing import Any

from lopa_op_helpers import (
    SAMPLES,
    is_available,
    load_sample,
    lopa,
    wait_status,
)

from kube.cluster import KubeCluster
from kube.kube_api import Api
from lopa_operator.status import pod_ready

NAME = "lopa-cpu"
GROUP_LABEL = "lopa.dev/group"


def deploy(kube: KubeCluster, ns: str, replicas: int) -> dict[str, Any]:
    (cr,) = load_sample("cpu.yaml")
    cr["spec"]["replicas"] = replicas
    kube.apply(cr, namespace=ns)
    return wait_status(
        kube, ns, NAME, lambda o: is_available(o) and o["status"].get("readyReplicas") == replicas,
        timeout=120, description=f"{replicas} groups Available",
    )


def group_pods(kube: KubeCluster, ns: str) -> dict[int, list[dict[str, Any]]]:
    """The live pods of each group, by group index."""
    items = kube.get_json("pods", "-n", ns, "-l", f"app.kubernetes.io/instance={NAME}")["items"]
    out: dict[int, list[dict[str, Any]]] = {}
    for pod in items:
        if not pod["metadata"].get("deletionTimestamp"):
            out.setdefault(int(pod["metadata"]["labels"][GROUP_LABEL]), []).append(pod)
    return out


def names_of(kube: KubeCluster, ns: str, kind: str) -> list[str]:
    items = kube.get_json(kind, "-n", ns, "-l", f"app.kubernetes.io/instance={NAME}")["items"]
    return sorted(o["metadata"]["name"] for o in items)


def test_replicas_make_groups_that_kubectl_scale_and_an_hpa_drive(kube: KubeCluster, ns: str) -> None:
    obj = deploy(kube, ns, 3)
    status = obj["status"]
    assert status["ready"] == "3/3" and status["replicas"] == 3 and status["readyWorkers"] == 6
    assert [g["index"] for g in status["groups"]] == [0, 1, 2]
    assert names_of(kube, ns, "statefulsets") == [f"{NAME}-{i}-worker" for i in range(3)]
    assert names_of(kube, ns, "deployments") == [f"{NAME}-{i}-master" for i in range(3)]
    assert {i: len(p) for i, p in group_pods(kube, ns).items()} == {0: 3, 1: 3, 2: 3}  # 2 workers + master
    # The client Service spans every group's master.
    # (the endpoints controller follows pod readiness a moment after the status does)
    def addresses() -> list[str] | None:
        slices = kube.get_json("endpointslices", "-n", ns, "-l", f"kubernetes.io/service-name={NAME}")
        found = [a for s in slices["items"] for e in s.get("endpoints") or [] for a in e["addresses"]]
        return found if len(found) == 3 else None

    kube.wait_for(addresses, timeout=30, description="the client Service's 3 master endpoints")

    kube.kubectl("scale", "lopadeployment", NAME, "-n", ns, "--replicas=1")
    scaled = wait_status(
        kube, ns, NAME,
        lambda o: is_available(o) and o["status"]["replicas"] == 1 and len(o["status"]["groups"]) == 1,
        timeout=60, description="scaled to one group",
    )
    assert scaled["status"]["ready"] == "1/1"
    kube.wait_for(
        lambda: names_of(kube, ns, "statefulsets") == [f"{NAME}-0-worker"]
        and names_of(kube, ns, "deployments") == [f"{NAME}-0-master"]
        and names_of(kube, ns, "configmaps") == [f"{NAME}-0-config"]
        and set(group_pods(kube, ns)) == {0},
        timeout=60, description="groups 1 and 2 removed with their pods",
    )
    scale_path = f"/apis/lopa.dev/v1alpha1/namespaces/{ns}/lopadeployments/{NAME}/scale"
    scale = json.loads(kube.kubectl("get", "--raw", scale_path).stdout)
    assert scale["spec"]["replicas"] == 1 and scale["status"]["replicas"] == 1
    assert "app.kubernetes.io/component=master" in scale["status"]["selector"]

    # The controller-manager's HPA controller resolves the scale subresource of the sample's target.
    kube.kubectl("apply", "-n", ns, "-f", str(SAMPLES / "hpa.yaml"))

    def able_to_scale() -> dict[str, Any] | None:
        hpa = kube.get_json("hpa", NAME, "-n", ns)
        conditions = {c["type"]: c for c in (hpa.get("status") or {}).get("conditions") or []}
        able = conditions.get("AbleToScale", {})
        return hpa if able.get("status") == "True" else None

    hpa = kube.wait_for(able_to_scale, timeout=90, interval=2, description="HPA AbleToScale=True")
    reason = {c["type"]: c for c in hpa["status"]["conditions"]}["AbleToScale"]["reason"]
    assert reason == "SucceededGetScale"
    kube.kubectl("delete", "hpa", NAME, "-n", ns)


def test_a_deleted_worker_of_group_2_recreates_group_2_only(kube: KubeCluster, ns: str) -> None:
    deploy(kube, ns, 3)
    before = {i: {p["metadata"]["uid"] for p in pods} for i, pods in group_pods(kube, ns).items()}
    kube.kubectl("delete", "pod", f"{NAME}-2-worker-0", "-n", ns, "--wait=false")
    final = wait_status(
        kube, ns, NAME,
        lambda o: is_available(o) and (o["status"]["groups"][2].get("restarts") or 0) == 1,
        timeout=90, description="group 2 recreated and Available",
    )
    assert [g.get("restarts", 0) for g in final["status"]["groups"]] == [0, 0, 1]
    assert final["status"]["groupRestarts"] == 1
    after = {i: {p["metadata"]["uid"] for p in pods} for i, pods in group_pods(kube, ns).items()}
    assert after[0] == before[0] and after[1] == before[1]  # masters and workers untouched
    workers_2 = {p["metadata"]["uid"] for p in group_pods(kube, ns)[2] if "-worker-" in p["metadata"]["name"]}
    assert not workers_2 & before[2]  # every worker of group 2 is new


class GroupWatch:
    """Watches the deployment's pods and records, after every event, how many groups are down
    (a group is up when its master and all its workers exist, not terminating, and are Ready)."""

    def __init__(self, kube: KubeCluster, ns: str, workers: int) -> None:
        self.api = Api(kube.kubeconfig)
        self.ns, self.workers = ns, workers
        self.pods: dict[str, dict[str, Any]] = {}
        self.down_counts: list[int] = []
        self.stop = threading.Event()
        listed = self.api.request("GET", f"/api/v1/namespaces/{ns}/pods", labelSelector=self._selector)
        for pod in listed["items"]:
            self.pods[pod["metadata"]["uid"]] = pod
        self.version = listed["metadata"]["resourceVersion"]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    _selector = f"app.kubernetes.io/instance={NAME}"

    def down(self) -> int:
        up: dict[int, tuple[int, int]] = {}
        for pod in self.pods.values():
            if pod["metadata"].get("deletionTimestamp") or not pod_ready(pod):
                continue
            index = int(pod["metadata"]["labels"][GROUP_LABEL])
            masters, workers = up.get(index, (0, 0))
            role = pod["metadata"]["labels"]["app.kubernetes.io/component"]
            up[index] = (masters + (role == "master"), workers + (role == "worker"))
        return sum(1 for i in range(3) if up.get(i, (0, 0)) < (1, self.workers))

    def _run(self) -> None:
        while not self.stop.is_set():
            for event in self.api.watch(f"/api/v1/namespaces/{self.ns}/pods", self.version, 5,
                                        labelSelector=self._selector):
                pod = event["object"]
                self.version = pod["metadata"].get("resourceVersion", self.version)
                if event["type"] == "DELETED":
                    self.pods.pop(pod["metadata"]["uid"], None)
                elif event["type"] in ("ADDED", "MODIFIED"):
                    self.pods[pod["metadata"]["uid"]] = pod
                self.down_counts.append(self.down())
                if self.stop.is_set():
                    return

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=15)
        self.api.close()


def test_a_decoding_change_rolls_one_group_at_a_time(kube: KubeCluster, ns: str) -> None:
    before = deploy(kube, ns, 3)
    watch = GroupWatch(kube, ns, workers=2)
    statuses: list[int] = []

    def rolled(o: dict[str, Any]) -> bool:
        groups = (o.get("status") or {}).get("groups") or []
        statuses.append(sum(not g.get("available") for g in groups))
        return is_available(o) and all(g["configHash"] == o["status"]["configHash"] for g in groups) and (
            o["status"]["configHash"] != before["status"]["configHash"]
        )

    try:
        kube.kubectl("patch", "lopadeployment", NAME, "-n", ns, "--type=merge",
                     "-p", json.dumps({"spec": {"decoding": {"tauConf": 0.8}}}))
        final = wait_status(kube, ns, NAME, rolled, timeout=180, description="every group on the new config")
    finally:
        watch.close()
    assert max(watch.down_counts) == 1, watch.down_counts  # one group down at a time, seen on the pods
    assert max(statuses) <= 1, statuses  # and in the status the operator writes
    assert watch.down_counts.count(0) >= 2  # it did go down and come back (3 groups rolled in turn)
    assert final["status"]["updatedReplicas"] == 3 and final["status"]["groupRestarts"] == 0
    for pods in group_pods(kube, ns).values():
        assert {p["metadata"]["annotations"]["lopa.dev/config-hash"] for p in pods} == {
            final["status"]["configHash"]
        }
    assert lopa(kube, ns, NAME)["status"]["readyReplicas"] == 3
