"""Acceptance of the operator on a real control plane with fake GPU/Ascend/CPU nodes.

One operator process (chart ServiceAccount credentials, 1 s resync) serves the whole module;
each test works in its own namespace and deletes its LoPADeployments before the next.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from lopa_op_helpers import (
    RESYNC_SECONDS,
    SAMPLES,
    OperatorProcess,
    bind_model_volume,
    condition,
    is_available,
    load_sample,
    pods,
    wait_status,
)

from kube.cluster import KubeCluster
from lopa_operator import __version__

NVIDIA = "d2f-dream"
CHILDREN = [
    ("configmap", "{}-0-config"),
    ("service", "{}-workers"),
    ("statefulset", "{}-0-worker"),
    ("deployment", "{}-0-master"),
    ("service", "{}"),
]


@pytest.fixture
def ns(ns: str, kube: KubeCluster) -> Iterator[str]:
    yield ns  # the conftest's namespace and operator, plus the model volume's PV
    kube.kubectl("delete", "pv", f"models-{ns}", "--ignore-not-found", "--wait=false", check=False)


def deploy_nvidia(kube: KubeCluster, ns: str) -> dict[str, Any]:
    bind_model_volume(kube, ns)
    kube.kubectl("apply", "-n", ns, "-f", str(SAMPLES / "nvidia.yaml"))
    return wait_status(kube, ns, NVIDIA, is_available, timeout=90, description="NVIDIA sample Available")


def uids(items: list[dict[str, Any]]) -> set[str]:
    return {p["metadata"]["uid"] for p in items}


def events(kube: KubeCluster, ns: str, name: str) -> list[dict[str, Any]]:
    return kube.get_json("events", "-n", ns, "--field-selector", f"involvedObject.name={name}")["items"]


def wait_events(kube: KubeCluster, ns: str, name: str, reason: str) -> list[dict[str, Any]]:
    """The object's events of this reason, once there is one. kopf posts the operator's events from
    a background task, after the reconcile that wrote the status the test waited for."""
    return kube.wait_for(
        lambda: [e for e in events(kube, ns, name) if e["reason"] == reason],
        timeout=30, description=f"a {reason} event of {name}",
    )


def test_nvidia_sample_children_pods_status_columns(kube: KubeCluster, ns: str) -> None:
    obj = deploy_nvidia(kube, ns)
    for kind, pattern in CHILDREN:
        child = kube.get_json(kind, pattern.format(NVIDIA), "-n", ns)
        (owner,) = child["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == (
            "LoPADeployment",
            NVIDIA,
            obj["metadata"]["uid"],
        )
        assert owner["controller"] is True and owner["blockOwnerDeletion"] is True

    workers = pods(kube, ns, NVIDIA)
    assert len(workers) == 4
    for pod in workers:
        container = pod["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert pod["spec"]["nodeName"].startswith("kwok-gpu-"), pod["spec"]["nodeName"]
        assert container["command"][-2:] == ["--rank", "$(LOPA_RANK)"]
    assert sorted(p["metadata"]["labels"]["apps.kubernetes.io/pod-index"] for p in workers) == [
        "0",
        "1",
        "2",
        "3",
    ]

    status = obj["status"]
    assert status["readyWorkers"] == 4 and status["ready"] == "1/1" and status["groupRestarts"] == 0
    assert status["endpoint"] == f"{NVIDIA}.{ns}.svc:50051"
    for kind in ("Available", "CollectiveReady", "Schedulable"):
        assert condition(obj, kind)["status"] == "True", kind
    assert condition(obj, "Degraded")["status"] == "False"

    client = kube.get_json("service", NVIDIA, "-n", ns)
    grpc = next(p for p in client["spec"]["ports"] if p["name"] == "grpc")
    assert grpc["appProtocol"] == "grpc" and grpc["port"] == 50051
    headless = kube.get_json("service", f"{NVIDIA}-workers", "-n", ns)["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True

    table = kube.kubectl("get", "lopa", "-n", ns).stdout.splitlines()
    header = ["NAME", "READY", "ACCELERATOR", "WORKERS", "BRANCHES", "PHASE", "RECONCILED", "AGE"]
    assert table[0].split() == header
    assert table[1].split()[:7] == [NVIDIA, "1/1", "nvidia", "4", "7", "Available", "True"]
    assert wait_events(kube, ns, NVIDIA, "Available")


def test_decoding_change_rolls_every_pod(kube: KubeCluster, ns: str) -> None:
    obj = deploy_nvidia(kube, ns)
    old_workers, old_masters = uids(pods(kube, ns, NVIDIA)), uids(pods(kube, ns, NVIDIA, "master"))
    old_hash, generation = obj["status"]["configHash"], obj["metadata"]["generation"]

    patch = {"spec": {"decoding": {"tauConf": 0.8}}}
    kube.kubectl("patch", "lopa", NVIDIA, "-n", ns, "--type=merge", "-p", json.dumps(patch))

    def rolled(o: dict[str, Any]) -> bool:
        new_hash = o["status"].get("configHash")
        if not is_available(o) or new_hash == old_hash or o["status"]["observedGeneration"] != generation + 1:
            return False
        workers, masters = pods(kube, ns, NVIDIA), pods(kube, ns, NVIDIA, "master")
        every = workers + masters
        return (
            len(workers) == 4
            and len(masters) == 1
            and not (uids(workers) & old_workers or uids(masters) & old_masters)
            and all(p["metadata"]["annotations"]["lopa.dev/config-hash"] == new_hash for p in every)
        )

    final = wait_status(kube, ns, NVIDIA, rolled, timeout=90, description="group rolled to the new config")
    config = yaml.safe_load(kube.get_json("configmap", f"{NVIDIA}-0-config", "-n", ns)["data"]["lopa.yaml"])
    assert config["decoding"]["tau_conf"] == 0.8
    assert final["status"]["groupRestarts"] == 0  # a roll is not a failure
    assert wait_events(kube, ns, NVIDIA, "RollingGroup")


def test_lost_worker_recreates_whole_group(kube: KubeCluster, ns: str) -> None:
    deploy_nvidia(kube, ns)
    before = uids(pods(kube, ns, NVIDIA))
    kube.kubectl("delete", "pod", f"{NVIDIA}-0-worker-1", "-n", ns, "--wait=false")

    def recreated(o: dict[str, Any]) -> bool:
        workers = pods(kube, ns, NVIDIA)
        return (
            o["status"].get("groupRestarts") == 1
            and is_available(o)
            and len(workers) == 4
            and not uids(workers) & before
        )

    final = wait_status(kube, ns, NVIDIA, recreated, timeout=90, description="whole group recreated")
    assert final["status"]["recentGroupRestarts"] == 1
    restarts = wait_events(kube, ns, NVIDIA, "GroupRestart")
    assert "recreating all 4 worker pod(s)" in restarts[0]["message"]


def test_restarts_exhausted_is_degraded(kube: KubeCluster, ns: str) -> None:
    (cr,) = load_sample("cpu.yaml")
    cr["spec"]["failurePolicy"] = {"maxGroupRestarts": 0}
    kube.apply(cr, namespace=ns)
    name = cr["metadata"]["name"]
    wait_status(kube, ns, name, is_available, timeout=90, description="CPU deployment Available")
    kube.kubectl("delete", "pod", f"{name}-0-worker-0", "-n", ns, "--wait=false")
    final = wait_status(
        kube, ns, name, lambda o: o["status"].get("phase") == "Degraded", timeout=60, description="Degraded"
    )
    assert condition(final, "Degraded")["reason"] == "GroupRestartsExhausted"
    assert "maxGroupRestarts=0" in condition(final, "Degraded")["message"]
    assert condition(final, "Available")["status"] == "False"
    assert final["status"]["groupRestarts"] == 0  # bounded: nothing was recreated
    # Bumping spec.restartTrigger recreates the Degraded group, its restart count cleared.
    before = {p["metadata"]["uid"] for p in kube.get_json("pods", "-n", ns)["items"]
              if p["metadata"]["name"].startswith(f"{name}-0-worker-")}
    kube.kubectl("patch", "lopadeployment", name, "-n", ns, "--type=merge",
                 "-p", '{"spec": {"restartTrigger": "retry-1"}}')
    healed = wait_status(kube, ns, name, is_available, timeout=90, description="Available again")
    assert healed["status"]["recentGroupRestarts"] == 0
    after = {p["metadata"]["uid"] for p in kube.get_json("pods", "-n", ns)["items"]
             if p["metadata"]["name"].startswith(f"{name}-0-worker-")}
    assert after and not after & before


def test_too_many_gpus_is_unschedulable_naming_resource(kube: KubeCluster, ns: str) -> None:
    cr = {
        "apiVersion": "lopa.dev/v1alpha1",
        "kind": "LoPADeployment",
        "metadata": {"name": "too-big"},
        # One GPU per worker (the CRD's cap); 20 workers outnumber the 16 GPUs of the two fake nodes.
        "spec": {"accelerator": {"type": "nvidia"}, "branchParallelism": 20},
    }
    start = time.monotonic()
    kube.apply(cr, namespace=ns)

    def unschedulable(o: dict[str, Any]) -> bool:
        c = condition(o, "Schedulable")
        return c.get("status") == "False" and "nvidia.com/gpu" in c.get("message", "")

    final = wait_status(kube, ns, "too-big", unschedulable, timeout=60, description="Schedulable=False")
    assert time.monotonic() - start < 60
    sched = condition(final, "Schedulable")
    assert sched["reason"] == "InsufficientResources" and sched["message"].startswith(
        "Insufficient nvidia.com/gpu"
    )
    assert final["status"]["phase"] == "Pending"
    assert condition(final, "Available")["status"] == "False"


def test_a_group_required_on_one_node_waits_when_none_fits_it(kube: KubeCluster, ns: str) -> None:
    cr = {
        "apiVersion": "lopa.dev/v1alpha1", "kind": "LoPADeployment", "metadata": {"name": "strict"},
        # 9 workers, 8 GPUs a node: 16 GPUs in all, but not 9 on one node
        "spec": {"accelerator": {"type": "nvidia"}, "branchParallelism": 9,
                 "placement": {"sameNode": "Required"}},
    }
    def gpus_held() -> list[str]:  # by earlier tests' pods, until kwok removes them
        return [p["metadata"]["name"] for p in kube.get_json("pods", "-A")["items"]
                if p["spec"].get("nodeName") and any(
                    "nvidia.com/gpu" in (c.get("resources") or {}).get("limits", {})
                    for c in p["spec"]["containers"])]

    kube.wait_for(lambda: not gpus_held(), timeout=60, description="every GPU free")
    kube.apply(cr, namespace=ns)

    def stuck(o: dict[str, Any]) -> bool:
        return condition(o, "Schedulable").get("status") == "False"

    final = wait_status(kube, ns, "strict", stuck, timeout=60, description="Schedulable=False")
    assert final["status"]["phase"] == "Pending"
    sched = condition(final, "Schedulable")
    assert sched["reason"] == "GroupDoesNotFitOneNode", sched
    assert sched["message"].startswith("the group's workers must share one node (spec.placement"), sched
    workers = pods(kube, ns, "strict")
    placed = [p["spec"]["nodeName"] for p in workers if p["spec"].get("nodeName")]
    assert len(placed) == 8 and len(set(placed)) == 1, placed


def test_deleting_resource_removes_every_child(kube: KubeCluster, ns: str) -> None:
    deploy_nvidia(kube, ns)
    start = time.monotonic()
    kube.kubectl("delete", "lopa", NVIDIA, "-n", ns, "--timeout=60s")
    selector = f"app.kubernetes.io/instance={NVIDIA}"

    def gone() -> bool:
        left = kube.get_json(
            "configmaps,services,statefulsets,deployments,replicasets,pods", "-n", ns, "-l", selector
        )
        return not left["items"]

    kube.wait_for(gone, timeout=60, description="every child garbage-collected")
    # The operator's finalizer must not hold the deletion up (kopf would wait 60 s by default).
    assert time.monotonic() - start < 30


def test_ascend_sample_renders_hccl_and_ascend_resource(kube: KubeCluster, ns: str) -> None:
    claim = next(d for d in load_sample("nvidia.yaml") if d["kind"] == "PersistentVolumeClaim")
    bind_model_volume(kube, ns)
    kube.apply(claim, namespace=ns)
    kube.kubectl("apply", "-n", ns, "-f", str(SAMPLES / "ascend.yaml"))
    name = "d2f-dream-ascend"
    wait_status(kube, ns, name, is_available, timeout=90, description="Ascend sample Available")
    sts = kube.get_json("statefulset", f"{name}-0-worker", "-n", ns)
    container = sts["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert {"HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT", "HCCL_IF_IP"} <= set(env)
    assert container["resources"]["limits"]["huawei.com/Ascend910"] == "1"
    config = yaml.safe_load(kube.get_json("configmap", f"{name}-0-config", "-n", ns)["data"]["lopa.yaml"])
    assert config["workers"]["backend"] == "hccl" and config["model"]["device"] == "npu"
    assert all(p["spec"]["nodeName"].startswith("kwok-ascend-") for p in pods(kube, ns, name))


def test_cpu_sample_renders_gloo(kube: KubeCluster, ns: str) -> None:
    kube.kubectl("apply", "-n", ns, "-f", str(SAMPLES / "cpu.yaml"))
    final = wait_status(kube, ns, "lopa-cpu", is_available, timeout=90, description="CPU sample Available")
    assert final["status"]["ready"] == "1/1" and final["status"]["readyWorkers"] == 2
    config = yaml.safe_load(kube.get_json("configmap", "lopa-cpu-0-config", "-n", ns)["data"]["lopa.yaml"])
    assert config["workers"]["backend"] == "gloo" and config["model"]["device"] == "cpu"
    assert config["model"]["path"] == ""  # the runtime's bundled model
    for pod in pods(kube, ns, "lopa-cpu"):
        limits = pod["spec"]["containers"][0]["resources"].get("limits", {})
        assert not any(key.endswith("/gpu") or "Ascend" in key for key in limits)


def test_drift_is_repaired_by_resync(kube: KubeCluster, ns: str, operator: OperatorProcess) -> None:
    kube.kubectl("apply", "-n", ns, "-f", str(SAMPLES / "cpu.yaml"))
    wait_status(kube, ns, "lopa-cpu", is_available, timeout=90, description="CPU sample Available")
    # Settled (its pods run, its StatefulSet's status holds still), a resync reads the StatefulSet
    # and does not apply it again: nothing drifted.
    applied = _stateful_set_applies(operator)
    kube.wait_for(lambda: _settled(operator, applied), timeout=60, description="no StatefulSet apply for 4 s")
    # Edits behind the operator's back are undone by the timer alone (no event on the CR).
    before = _stateful_set_applies(operator)
    kube.kubectl("scale", "statefulset", "lopa-cpu-0-worker", "-n", ns, "--replicas=0")
    kube.wait_for(
        lambda: kube.get_json("statefulset", "lopa-cpu-0-worker", "-n", ns)["spec"]["replicas"] == 2,
        timeout=30,
        description="StatefulSet replicas restored",
    )
    assert _stateful_set_applies(operator)["applied"] > before["applied"]
    wait_status(kube, ns, "lopa-cpu", is_available, timeout=60, description="Available again")


def _stateful_set_applies(operator: OperatorProcess) -> dict[str, float]:
    """The operator's StatefulSet applies by outcome (applied, unchanged)."""
    text = operator.http_get(operator.metrics_port, "/metrics")[1]
    found = re.findall(r'^lopa_operator_child_applies_total\{kind="StatefulSet",outcome="(\w+)"\} (\S+)$',
                       text, re.M)
    return {"applied": 0.0, "unchanged": 0.0, **{outcome: float(n) for outcome, n in found}}


def _settled(operator: OperatorProcess, last: dict[str, float]) -> bool:
    """True once 4 s of resyncs found the StatefulSet unchanged and applied it none (`last` is
    updated to the counts now, so each call compares with the one before)."""
    time.sleep(4 * RESYNC_SECONDS)
    now = _stateful_set_applies(operator)
    settled = now["applied"] == last["applied"] and now["unchanged"] >= last["unchanged"] + 3
    last.update(now)
    return settled


def test_operator_metrics_liveness_and_clean_log(operator: OperatorProcess, tmp_path: Path) -> None:
    # Runs last in this module: the log then covers every scenario above.
    assert operator.http_get(operator.liveness_port, "/healthz")[0] == 200
    status, text = operator.http_get(operator.metrics_port, "/metrics")
    assert status == 200
    assert 'lopa_operator_reconciles_total{result="ok",trigger="timer"}' in text
    assert "lopa_operator_group_restarts_total" in text and "lopa_operator_ready_workers" in text
    forbidden = operator.forbidden_lines()
    assert not forbidden, "operator hit RBAC denials:\n" + "\n".join(forbidden[:20])
    assert operator.process.poll() is None, operator.log()
    assert f"lopa-operator {__version__} watching all namespaces" in operator.log()  # its start line
