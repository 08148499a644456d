"""The Gateway API Inference Extension: the InferencePool sample and the operator's own pool
(spec.inferencePool), on the extension's real CRD (v1.3.1, fetched through the Go module proxy),
and a cluster without that CRD, where the operator reports it and its groups serve on."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from fake_kube import FakeKube
from lopa_op_helpers import (
    INFERENCE_POOL_CRD,
    SAMPLES,
    condition,
    inference_extension,
    load_sample,
    lopa,
    wait_status,
)

from kube.cluster import KubeCluster
from lopa_operator import names, reconcile, render
from lopa_operator.kube import KubeError, path

POOLED = {
    "service": {"httpPort": 8000},
    "inferencePool": {"enabled": True, "endpointPicker": {"name": "epp"}},
}


def run(fake: FakeKube, posted: list[tuple[str, str]]) -> dict[str, Any]:
    def post(obj: dict[str, Any], kind: str, reason: str, message: str) -> None:
        posted.append((reason, message))

    out = reconcile.reconcile(fake, "ns", "d", "test", post, logging.getLogger("t"), fake.memo)  # type: ignore[arg-type]
    assert out is not None
    return out


def pool_condition(status: dict[str, Any]) -> dict[str, Any] | None:
    return next((c for c in status["conditions"] if c["type"] == "InferencePool"), None)


def test_a_missing_crd_is_reported_once_and_the_groups_are_still_made() -> None:
    fake = FakeKube.with_deployment(POOLED)
    fake.reject = ("InferencePool", 404, "the server could not find the requested resource")
    posted: list[tuple[str, str]] = []
    status = run(fake, posted)
    assert "d-0-worker" in fake.of_kind("StatefulSet")  # the groups do not wait for the pool
    cond = pool_condition(status)
    assert cond and cond["status"] == "False" and cond["reason"] == "CRDNotInstalled"
    assert INFERENCE_POOL_CRD in cond["message"] and "spec.inferencePool" in cond["message"]
    fake.patch_status("ns", "d", status)
    run(fake, posted)
    assert [r for r, _ in posted].count("InferencePoolUnavailable") == 1  # once, not every resync

    fake.reject = None  # the CRD is installed: the next try (at once after a change) applies it
    fake.memo.pop("pool")
    status = run(fake, posted)
    assert pool_condition(status)["status"] == "True"  # type: ignore[index]
    pool = fake.objects[path("InferencePool", "ns", "d")]
    assert pool["spec"]["selector"]["matchLabels"] == names.labels("d", names.ROLE_MASTER)
    assert pool["metadata"]["ownerReferences"][0]["uid"] == "cr-uid"

    fake.patch_status("ns", "d", status)
    fake.objects[path(names.KIND, "ns", "d")]["spec"] = {"service": {"httpPort": 8000}}  # disabled
    status = run(fake, posted)
    assert pool_condition(status) is None and path("InferencePool", "ns", "d") not in fake.objects


def test_a_server_error_is_retried_by_kopf() -> None:
    fake = FakeKube.with_deployment(POOLED)
    fake.reject = ("InferencePool", 503, "etcd leader changed")
    with pytest.raises(KubeError):
        run(fake, [])


def test_render_prints_the_pool_with_the_other_children(tmp_path: Path) -> None:
    from lopa_operator.__main__ import render_file

    source = tmp_path / "d.yaml"
    source.write_text(yaml.safe_dump({"apiVersion": names.API_VERSION, "kind": names.KIND,
                                      "metadata": {"name": "d"}, "spec": POOLED}))
    docs = list(yaml.safe_load_all(render_file(str(source))))
    (pool,) = [d for d in docs if d["kind"] == "InferencePool"]
    picker = {"name": "epp", "port": {"number": 9002}, "failureMode": "FailClose"}
    assert pool["spec"]["endpointPickerRef"] == picker
    source.write_text(yaml.safe_dump({"apiVersion": names.API_VERSION, "kind": names.KIND,
                                      "metadata": {"name": "d"}, "spec": {}}))
    assert "InferencePool" not in [d["kind"] for d in yaml.safe_load_all(render_file(str(source)))]


def within(given: Any, stored: Any) -> bool:
    """Every field of `given` is in `stored` with the same value."""
    if isinstance(given, dict):
        return isinstance(stored, dict) and all(k in stored and within(v, stored[k])
                                                for k, v in given.items())
    return bool(given == stored)


def _epp_flags(options_go: str) -> set[str]:
    return set(re.findall(r'fs\.\w+Var\w*\([^,]+,\s*"([a-z-]+)"', options_go))


def test_the_sample_fits_the_extensions_crd_and_selects_the_masters(
    kube: KubeCluster, namespace: str
) -> None:
    """manifests/samples/inferencepool.yaml on the real CRD with strict field validation (a misspelt
    key is an error, nothing is pruned); its pool selects the masters the operator renders for
    lopa-cpu, on their HTTP port; its endpoint picker's flags exist in the pinned release."""
    fetched = inference_extension(kube)
    kube.kubectl("apply", "--validate=strict", "--server-side", "-n", namespace,
                 "-f", str(SAMPLES / "inferencepool.yaml"))
    (sample,) = [d for d in load_sample("inferencepool.yaml") if d["kind"] == "InferencePool"]
    stored = kube.get_json("inferencepool", sample["metadata"]["name"], "-n", namespace)
    assert within(sample["spec"], stored["spec"])  # nothing pruned (the CRD adds its defaults)

    (cr,) = load_sample("cpu.yaml")
    with_http = {**cr["spec"], "service": {"httpPort": 8000}}
    children = render.children(cr["metadata"]["name"], namespace, with_http)
    master = next(c for c in children if c["kind"] == "Deployment")["spec"]["template"]
    assert sample["spec"]["selector"]["matchLabels"].items() <= master["metadata"]["labels"].items()
    ports = {p["name"]: p["containerPort"] for p in master["spec"]["containers"][0]["ports"]}
    assert [p["number"] for p in sample["spec"]["targetPorts"]] == [ports["http"]]
    workers = next(c for c in children if c["kind"] == "StatefulSet")["spec"]["template"]
    assert not sample["spec"]["selector"]["matchLabels"].items() <= workers["metadata"]["labels"].items()

    (epp,) = [d for d in load_sample("inferencepool.yaml") if d["kind"] == "Deployment"]
    args = epp["spec"]["template"]["spec"]["containers"][0]["args"]
    given = {a.split("=", 1)[0].removeprefix("--"): a.split("=", 1)[1] for a in args}
    assert set(given) <= _epp_flags((fetched / "epp-options.go").read_text())
    assert given["total-queued-requests-metric"] == "vllm:num_requests_waiting"
    assert given["total-running-requests-metric"] == "vllm:num_requests_running"
    assert given["kv-cache-usage-percentage-metric"] == "vllm:kv_cache_usage_perc"
    assert given["lora-info-metric"] == given["cache-info-metric"] == ""
    (service,) = [d for d in load_sample("inferencepool.yaml") if d["kind"] == "Service"]
    picker = sample["spec"]["endpointPickerRef"]
    assert picker["name"] == service["metadata"]["name"]
    assert picker["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]


def test_the_operator_reports_a_missing_crd_then_owns_the_pool(kube: KubeCluster, ns: str) -> None:
    if kube.kubectl("get", f"crd/{INFERENCE_POOL_CRD}", check=False).returncode == 0:
        kube.kubectl("delete", f"crd/{INFERENCE_POOL_CRD}", "--wait=true", "--timeout=60s")
    spec = {"branchParallelism": 1, **POOLED}
    cr = {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": "gie"}, "spec": spec}
    kube.apply(cr, namespace=ns)
    missing = wait_status(
        kube, ns, "gie", lambda o: condition(o, "InferencePool").get("reason") == "CRDNotInstalled",
        description="InferencePool condition CRDNotInstalled",
    )
    assert condition(missing, "InferencePool")["status"] == "False"
    assert condition(missing, "Reconciled")["status"] == "True"  # the groups are made regardless
    assert kube.get_json("statefulset", "gie-0-worker", "-n", ns)
    events = kube.get_json("events", "-n", ns, "--field-selector", "reason=InferencePoolUnavailable")["items"]
    assert events and INFERENCE_POOL_CRD in events[0]["message"]

    inference_extension(kube)
    # The pool is tried again after --retry-refused-seconds (the operator does not call every resync).
    ready = wait_status(kube, ns, "gie", lambda o: condition(o, "InferencePool").get("status") == "True",
                        timeout=30, description="InferencePool condition True")
    pool = kube.get_json("inferencepool", "gie", "-n", ns)
    assert pool["metadata"]["ownerReferences"][0]["uid"] == ready["metadata"]["uid"]
    assert pool["spec"]["selector"]["matchLabels"] == names.labels("gie", names.ROLE_MASTER)
    assert pool["spec"]["targetPorts"] == [{"number": names.HTTP_PORT}]
    assert pool["spec"]["endpointPickerRef"] == {
        "group": "", "kind": "Service", "name": "epp", "port": {"number": 9002}, "failureMode": "FailClose",
    }

    kube.kubectl("patch", "lopadeployment", "gie", "-n", ns, "--type=merge",
                 "-p", yaml.safe_dump({"spec": {"inferencePool": {"enabled": False}}}))
    wait_status(kube, ns, "gie", lambda o: not condition(o, "InferencePool"),
                description="no InferencePool condition once disabled")
    assert kube.kubectl("get", "inferencepool", "gie", "-n", ns, check=False).returncode != 0
    assert lopa(kube, ns, "gie")["status"]["phase"] in ("Pending", "Progressing", "Available")
