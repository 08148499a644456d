"""The "restricted" Pod Security Standard, judged by the API server's own PodSecurity admission
plugin: in a namespace that enforces it, the pods the operator renders for every sample are
created, and so are the sample endpoint picker's and the operator's own."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from lopa_op_helpers import (
    CHART,
    RELEASE,
    RELEASE_NAMESPACE,
    bind_model_volume,
    load_sample,
    pods,
)

from kube.cluster import KubeCluster

ENFORCE = "pod-security.kubernetes.io/enforce"


@pytest.fixture
def restricted(ns: str, kube: KubeCluster) -> Iterator[str]:
    kube.kubectl("label", "namespace", ns, f"{ENFORCE}=restricted", f"{ENFORCE}-version=latest")
    yield ns
    kube.kubectl("delete", "pv", f"models-{ns}", "--ignore-not-found", "--wait=false", check=False)


def pod_from(template: dict[str, Any], name: str) -> dict[str, Any]:
    metadata = {**copy.deepcopy(template["metadata"]), "name": name}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": copy.deepcopy(template["spec"])}


def admitted(kube: KubeCluster, ns: str, pod: dict[str, Any]) -> str:
    """'' when PodSecurity admits the pod (a dry run: nothing is created), else the API's refusal."""
    result = kube.kubectl("create", "--dry-run=server", "-n", ns, "-f", "-", input=yaml.safe_dump(pod),
                          check=False)
    return "" if result.returncode == 0 else result.stderr


def test_the_namespace_refuses_a_root_pod(kube: KubeCluster, restricted: str) -> None:
    """The PodSecurity admission plugin is on (kube-apiserver's default plugins): without it every
    other test here would pass for nothing."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "root"},
           "spec": {"containers": [{"name": "c", "image": "busybox"}]}}
    assert 'violates PodSecurity "restricted:latest"' in admitted(kube, restricted, pod)


@pytest.mark.parametrize("file", ["cpu.yaml", "nvidia.yaml", "ascend.yaml"])
def test_every_samples_pods_are_admitted(kube: KubeCluster, restricted: str, file: str) -> None:
    docs = load_sample(file)
    if file == "ascend.yaml":  # it mounts nvidia.yaml's claim
        docs = [d for d in load_sample("nvidia.yaml") if d["kind"] == "PersistentVolumeClaim"] + docs
    if any(d["kind"] == "PersistentVolumeClaim" for d in docs):
        bind_model_volume(kube, restricted)
    kube.apply(docs, namespace=restricted)
    (cr,) = [d for d in docs if d["kind"] == "LoPADeployment"]
    name, workers = cr["metadata"]["name"], cr["spec"]["branchParallelism"]
    # The StatefulSet and ReplicaSet controllers create the pods (PodSecurity judges each): a refused
    # one would leave only a FailedCreate event behind.
    def created() -> bool:
        return len(pods(kube, restricted, name)) == workers and bool(pods(kube, restricted, name, "master"))

    kube.wait_for(created, timeout=60, description=f"{name}'s pods created")
    for kind, child in (("statefulset", f"{name}-0-worker"), ("deployment", f"{name}-0-master")):
        template = kube.get_json(kind, child, "-n", restricted)["spec"]["template"]
        assert admitted(kube, restricted, pod_from(template, f"check-{kind}")) == ""
    events = kube.get_json("events", "-n", restricted, "--field-selector", "reason=FailedCreate")["items"]
    assert not events, [e["message"] for e in events]


def test_the_sample_endpoint_picker_and_the_operator_are_admitted(kube: KubeCluster, restricted: str) -> None:
    (epp,) = [d for d in load_sample("inferencepool.yaml") if d["kind"] == "Deployment"]
    picker = pod_from(epp["spec"]["template"], "epp")
    picker["spec"]["serviceAccountName"] = "default"  # (the sample's own comes with it)
    assert admitted(kube, restricted, picker) == ""
    chart = kube.helm("template", RELEASE, str(CHART), "-n", RELEASE_NAMESPACE, "--kube-version", "1.30.0")
    (operator,) = [d for d in yaml.safe_load_all(chart.stdout) if d and d["kind"] == "Deployment"]
    template = operator["spec"]["template"]
    template["spec"]["serviceAccountName"] = "default"  # the chart's lives in its own namespace
    assert admitted(kube, restricted, pod_from(template, "operator")) == ""
