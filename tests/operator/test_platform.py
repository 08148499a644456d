"""Smoke tests of the test platform itself: a real control plane with kwok fake nodes.

Each test proves one component does its real job: the API server (version, RBAC,
TokenRequest), the scheduler (fit on extended resources), the controller-manager
(Deployments, garbage collection) and kwok (fake nodes and pods becoming Ready).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from kube.cluster import CommandError, KubeCluster
from kube.nodes import ASCEND_RESOURCE, GPU_RESOURCE

REPO_ROOT = Path(__file__).resolve().parents[2]


def _pinned_kubernetes_version() -> str:
    go_mod = (REPO_ROOT / "tools" / "k8s-testenv" / "kubernetes" / "go.mod").read_text()
    match = re.search(r"^\s*(?:require\s+)?k8s\.io/kubernetes (v\S+)", go_mod, re.MULTILINE)
    assert match, "tools/k8s-testenv/kubernetes/go.mod pins no k8s.io/kubernetes version"
    return match.group(1)


def test_version_reports_the_built_release(kube: KubeCluster) -> None:
    expected = _pinned_kubernetes_version()
    assert kube.version["gitVersion"] == expected
    assert kube.version["minor"] == expected.split(".")[1]
    versions = json.loads(kube.kubectl("version", "-o", "json").stdout)
    assert versions["clientVersion"]["gitVersion"] == expected
    assert versions["serverVersion"]["gitVersion"] == expected


def test_fake_nodes_are_ready_with_accelerator_capacity(kube: KubeCluster, kube_api: Any) -> None:
    from kubernetes import client

    nodes = {node.metadata.name: node for node in client.CoreV1Api(kube_api).list_node().items}
    assert sorted(nodes) == sorted(node.name for node in kube.nodes)
    assert len(nodes) == 6
    for fake in kube.nodes:
        node = nodes[fake.name]
        ready = [c for c in node.status.conditions if c.type == "Ready"]
        assert ready and ready[0].status == "True", f"{fake.name} is not Ready"
        for resource in (GPU_RESOURCE, ASCEND_RESOURCE):
            expected = fake.accelerators.get(resource)
            assert node.status.capacity.get(resource) == (str(expected) if expected else None)
            assert node.status.allocatable.get(resource) == (str(expected) if expected else None)
    counts = {
        resource: sum(1 for node in kube.nodes if resource in node.accelerators)
        for resource in (GPU_RESOURCE, ASCEND_RESOURCE)
    }
    assert counts == {GPU_RESOURCE: 2, ASCEND_RESOURCE: 2}


def _gpu_deployment(name: str) -> dict[str, Any]:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "nodeSelector": {"nvidia.com/gpu.present": "true"},
                    "containers": [
                        {
                            "name": "server",
                            "image": "registry.invalid/lopa/runtime:test",  # kwok never pulls it
                            "resources": {"limits": {GPU_RESOURCE: "1"}},
                        }
                    ],
                },
            },
        },
    }


def test_gpu_deployment_becomes_available(kube: KubeCluster, namespace: str) -> None:
    kube.apply(_gpu_deployment("gpu-server"), namespace=namespace)
    kube.kubectl("rollout", "status", "deployment/gpu-server", "-n", namespace, "--timeout=90s")
    pods = kube.get_json("pods", "-n", namespace, "-l", "app=gpu-server")["items"]
    assert len(pods) == 2
    gpu_nodes = {node.name for node in kube.nodes if GPU_RESOURCE in node.accelerators}
    for pod in pods:
        assert pod["status"]["phase"] == "Running"
        assert pod["spec"]["nodeName"] in gpu_nodes
        ready = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
        assert ready.get("Ready") == "True"
    deployment = kube.get_json("deployment", "gpu-server", "-n", namespace)
    assert deployment["status"]["availableReplicas"] == 2


def test_pod_asking_for_too_many_gpus_stays_pending(kube: KubeCluster, namespace: str) -> None:
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "too-big"},
            "spec": {
                "containers": [
                    {
                        "name": "c",
                        "image": "registry.invalid/x:1",
                        "resources": {"limits": {GPU_RESOURCE: "100"}},
                    }
                ]
            },
        },
        namespace=namespace,
    )

    def failed_scheduling_message() -> str | None:
        events = kube.get_json(
            "events", "-n", namespace,
            "--field-selector", "involvedObject.name=too-big,reason=FailedScheduling",
        )["items"]
        return events[0]["message"] if events else None

    message = kube.wait_for(failed_scheduling_message, timeout=60, description="a FailedScheduling event")
    assert f"Insufficient {GPU_RESOURCE}" in message
    pod = kube.get_json("pod", "too-big", "-n", namespace)
    assert pod["status"]["phase"] == "Pending"
    assert "nodeName" not in pod["spec"]


def test_serviceaccount_without_rbac_is_forbidden(kube: KubeCluster, namespace: str) -> None:
    kubeconfig = kube.serviceaccount_kubeconfig(namespace, "no-rights")
    whoami = json.loads(kube.kubectl("auth", "whoami", "-o", "json", kubeconfig=kubeconfig).stdout)
    assert whoami["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:no-rights"

    denied = kube.kubectl("get", "pods", "-n", namespace, kubeconfig=kubeconfig, check=False)
    assert denied.returncode != 0
    assert "Forbidden" in denied.stderr and "cannot list resource \"pods\"" in denied.stderr

    # With a Role bound, the same token may list pods: RBAC, not the token, made the difference.
    kube.kubectl("create", "role", "pod-reader", "--verb=list,get", "--resource=pods", "-n", namespace)
    kube.kubectl(
        "create", "rolebinding", "pod-reader", "--role=pod-reader",
        f"--serviceaccount={namespace}:no-rights", "-n", namespace,
    )
    kube.wait_for(
        lambda: kube.kubectl("get", "pods", "-n", namespace, kubeconfig=kubeconfig, check=False).returncode
        == 0,
        timeout=30,
        description="the RoleBinding to take effect",
    )


def test_garbage_collector_deletes_owned_objects(kube: KubeCluster, namespace: str) -> None:
    kube.kubectl("create", "configmap", "owner", "-n", namespace)
    owner_uid = kube.get_json("configmap", "owner", "-n", namespace)["metadata"]["uid"]
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": "child",
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner_uid}
                ],
            },
            "data": {"k": "v"},
        },
        namespace=namespace,
    )
    # Background deletion: the API server deletes only the owner; the child must be
    # removed by the controller-manager's garbage collector.
    kube.kubectl("delete", "configmap", "owner", "-n", namespace, "--cascade=background")

    def child_gone() -> bool:
        try:
            kube.kubectl("get", "configmap", "child", "-n", namespace)
        except CommandError as exc:
            return "NotFound" in exc.result.stderr
        return False

    kube.wait_for(child_gone, timeout=60, description="the garbage collector to delete the child")


def test_helm_installs_a_chart(kube: KubeCluster, namespace: str, tmp_path: Path) -> None:
    version = kube.helm("version", "--short").stdout.strip()
    assert version.startswith("v3."), version
    kube.helm("create", str(tmp_path / "demo"))
    kube.helm(
        "install", "demo", str(tmp_path / "demo"), "-n", namespace, "--wait", "--timeout", "90s"
    )
    releases = json.loads(kube.helm("list", "-n", namespace, "-o", "json").stdout)
    assert [(r["name"], r["status"]) for r in releases] == [("demo", "deployed")]
    deployment = kube.get_json("deployment", "demo", "-n", namespace)
    assert deployment["status"]["availableReplicas"] == 1
