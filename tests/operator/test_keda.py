"""The KEDA sample (manifests/samples/keda.yaml) against KEDA's real ScaledObject CRD (keda.sh/v1alpha1,
from the module github.com/kedacore/keda/v2 v2.21.0 fetched through the Go module proxy by
tools/k8s-testenv/keda-crds.sh) on the test API server, and its Prometheus trigger against the keys
KEDA's Prometheus scaler of the same version reads. KEDA's operator itself does not run here: what
it would scale is the LoPADeployment's scale subresource, which test_replicas.py drives with an HPA.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from lopa_op_helpers import SAMPLES, ensure_chart, keda_crds, load_sample

from kube.cluster import CommandError, KubeCluster
from lopa_operator import names


@pytest.fixture(scope="module")
def keda(kube: KubeCluster) -> Path:
    """The fetched files' directory, with the ScaledObject CRD installed (and the LoPADeployment's)."""
    ensure_chart(kube)
    return keda_crds(kube)


def scaled_object() -> dict[str, Any]:
    (obj,) = load_sample("keda.yaml")
    return obj


def test_the_sample_is_accepted_and_targets_a_scalable_lopadeployment(
    kube: KubeCluster, keda: Path, namespace: str
) -> None:
    kube.kubectl("apply", "-n", namespace, "-f", str(SAMPLES / "cpu.yaml"))
    # kubectl's strict field validation: the server refuses any field the CRD's schema lacks
    kube.kubectl("apply", "--validate=strict", "-n", namespace, "-f", str(SAMPLES / "keda.yaml"))
    stored = kube.get_json("scaledobject", "lopa-cpu", "-n", namespace)
    assert stored["spec"]["triggers"] == scaled_object()["spec"]["triggers"]
    assert stored["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"] == {
        "stabilizationWindowSeconds": 600}
    target = stored["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"]) == (names.API_VERSION, names.KIND)
    # What KEDA's HPA will scale: the target's scale subresource (spec.replicas: the groups).
    scale_path = f"/apis/lopa.dev/v1alpha1/namespaces/{namespace}/lopadeployments/{target['name']}/scale"
    assert yaml.safe_load(kube.kubectl("get", "--raw", scale_path).stdout)["spec"]["replicas"] == 1

    # The CRD's schema is checked for real: a misspelt field is refused, naming it.
    bad = scaled_object()
    bad["metadata"]["name"] = "misspelt"
    bad["spec"]["triggers"][0]["metricTyp"] = bad["spec"]["triggers"][0].pop("metricType")
    with pytest.raises(CommandError) as refused:
        kube.kubectl("apply", "--validate=strict", "-n", namespace, "-f", "-", input=yaml.safe_dump(bad))
    assert 'unknown field "spec.triggers[0].metricTyp"' in refused.value.result.stderr


def test_the_trigger_asks_prometheus_for_the_masters_queue(keda: Path) -> None:
    (trigger,) = scaled_object()["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    # Every metadata key is one KEDA's Prometheus scaler of v2.21.0 reads, and the required are there.
    source = (keda / "prometheus_scaler.go").read_text()
    read = set(re.findall(r'keda:"name=(\w+),', source))
    assert set(trigger["metadata"]) <= read, set(trigger["metadata"]) - read
    assert {"serverAddress", "query", "threshold"} <= set(trigger["metadata"])
    # AverageValue: the query's total divided by the groups, held near the threshold (per group).
    assert trigger["metricType"] == "AverageValue" and float(trigger["metadata"]["threshold"]) > 0
    # lopa_queue_depth is the masters' gauge of waiting requests (lopa.serving.shared.vllm_metrics).
    query = trigger["metadata"]["query"]
    assert "lopa_queue_depth{" in query and 'pod=~"lopa-cpu-[0-9]+-master-.+"' in query
    masters = re.search(r'pod=~"([^"]+)"', query).group(1)  # type: ignore[union-attr]
    for group in (0, 11):  # a master pod is named <its Deployment>-<ReplicaSet hash>-<suffix>
        assert re.fullmatch(masters, f"{names.master('lopa-cpu', group)}-7d9f8c6b5-x2k4q")
        assert not re.fullmatch(masters, names.worker_pod("lopa-cpu", group, 1))
