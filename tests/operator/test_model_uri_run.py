"""spec.model.uri `hf://` end to end: the pods' init containers (`lopa fetch-model`) download the
bundled model from a Hugging Face Hub mirror into a cache claim, and the group serves it.

The mirror (tests/kube/hf_mirror.py: the Hub's HTTP API as huggingface_hub calls it) is the one part
that stands in for the outside world; it serves the runtime's bundled model as `lopa-dev/bundled`
on the pod network's gateway, named to the pods by spec.model.huggingFace.endpoint (HF_ENDPOINT).
The cache is spec.model.cache.claimName: a claim bound to a hostPath PersistentVolume, a directory
of this machine that outlives the pods. The pods run as real lopa processes on the process node
(kube.pod_runner), init containers first, as in tests/operator/test_pods_run.py.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from lopa_op_helpers import (
    OperatorProcess,
    ask_client_pod,
    condition,
    delete_all,
    is_available,
    load_sample,
    pods,
    process_node,
    wait_status,
)

from kube.cluster import KubeCluster
from kube.hf_mirror import HubMirror
from kube.pod_runner import PodRunner
from lopa.bundled import bundled_model_dir

pytestmark = pytest.mark.slow

NAME = "lopa-hub"
REPO = "lopa-dev/bundled"
PROMPT = "tail:gcecjki.ZVvrtus.WVbuklw="
CLAIM = "model-cache"
MODEL_DIR = f"/mnt/models/hf/{REPO}/v1"  # where the pods read it (model_source.py)
GROUP_TIMEOUT = 300.0  # three pods fetch, then load torch and the model, on a shared 2-core machine


@pytest.fixture(scope="module")
def runner(kube: KubeCluster) -> Iterator[PodRunner]:
    with process_node(kube) as pod_runner:
        yield pod_runner


@pytest.fixture(scope="module")
def mirror(runner: PodRunner) -> Iterator[HubMirror]:
    # On the pod network's gateway: the address the pods reach this machine at.
    with HubMirror(host=runner.network.gateway) as hub:
        hub.add(REPO, bundled_model_dir(), revisions=("main", "v1"))
        yield hub


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="module")
def ns(kube: KubeCluster, runner: PodRunner, mirror: HubMirror, cache: Path, operator: OperatorProcess
       ) -> Iterator[str]:
    name = f"t-model-uri-{secrets.token_hex(3)}"
    kube.kubectl("create", "namespace", name)
    kube.kubectl("label", "namespace", name, "lopa.dev/test=true",
                 "pod-security.kubernetes.io/enforce=restricted")
    kube.wait_for(lambda: runner.api.get(f"/api/v1/namespaces/{name}/serviceaccounts/default"),
                  timeout=30, description="the default ServiceAccount")
    volume = f"{name}-cache"
    kube.apply([
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": volume},
         "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
                  "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(cache)},
                  "claimRef": {"namespace": name, "name": CLAIM}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": CLAIM, "namespace": name},
         "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": volume,
                  "resources": {"requests": {"storage": "1Gi"}}}},
    ])
    sample = load_sample("cpu.yaml")[0]
    sample["metadata"]["name"] = NAME
    sample["spec"]["branchParallelism"] = 2
    sample["spec"]["model"] = {"uri": f"hf://{REPO}@v1", "cache": {"claimName": CLAIM},
                               "huggingFace": {"endpoint": mirror.url}}
    kube.apply(sample, namespace=name)
    try:
        yield name
    finally:
        print(f"--- operator log (tail) ---\n{chr(10).join(operator.log().splitlines()[-40:])}")
        print(runner.report())
        delete_all(kube, name)
        kube.kubectl("delete", "namespace", name, "--wait=false", check=False)
        kube.kubectl("delete", "pv", volume, "--wait=false", check=False)


@pytest.fixture(scope="module")
def expected() -> dict[str, Any]:
    """`lopa generate` on the bundled model with the sample's settings."""
    result = subprocess.run(
        [sys.executable, "-m", "lopa", "generate", "--prompt", PROMPT, "--branches", "3", "--json"],
        capture_output=True, text=True, timeout=180, check=True,
    )
    return dict(json.loads(result.stdout))


def wait(kube: KubeCluster, runner: PodRunner, ns: str, check: Any, what: str) -> dict[str, Any]:
    try:
        return wait_status(kube, ns, NAME, check, timeout=GROUP_TIMEOUT, description=what)
    except TimeoutError as error:
        raise TimeoutError(f"{error}\n{runner.report()}") from None


def group(kube: KubeCluster, ns: str) -> list[dict[str, Any]]:
    return pods(kube, ns, NAME) + pods(kube, ns, NAME, "master")


def fetch_logs(runner: PodRunner, ns: str, members: list[dict[str, Any]]) -> list[str]:
    return [runner.log(ns, p["metadata"]["name"], init="fetch-model") for p in members]


def test_the_group_fetches_the_model_once_and_answers_with_it(
    kube: KubeCluster, runner: PodRunner, ns: str, mirror: HubMirror, cache: Path, expected: dict[str, Any]
) -> None:
    wait(kube, runner, ns, is_available, "the group Available on the fetched model")
    commit = mirror.repos[REPO].commit
    held = cache / REPO / "v1"  # the claim is mounted at /mnt/models/hf
    assert (held / ".lopa-revision").read_text().strip() == commit
    weights = "model.safetensors"
    assert (held / weights).read_bytes() == (bundled_model_dir() / weights).read_bytes()
    # The three pods share the claim: the first fetched each file, the others found them there.
    fetched = sorted(r.split("/resolve/")[1].split("/", 1)[1] for r in mirror.downloads())
    assert fetched == sorted(p.name for p in bundled_model_dir().iterdir() if p.is_file())
    logs = fetch_logs(runner, ns, group(kube, ns))
    assert sum("downloaded" in log for log in logs) == 1, logs
    assert sum("already held in the cache; no download" in log for log in logs) == 2, logs
    config = yaml.safe_load(kube.get_json("configmap", f"{NAME}-0-config", "-n", ns)["data"]["lopa.yaml"])
    assert config["model"]["path"] == MODEL_DIR
    for pod in group(kube, ns):  # the runtime reads the cache read-only
        mounts = {m["mountPath"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
        assert mounts["/mnt/models/hf"]["readOnly"] is True
    answer = ask_client_pod(kube, runner, ns, NAME, PROMPT, "fetched")
    assert answer["text"] == expected["text"] and answer["tokens"] == expected["tokens"]


def test_a_second_start_finds_the_revision_in_the_cache(
    kube: KubeCluster, runner: PodRunner, ns: str, mirror: HubMirror
) -> None:
    before = wait(kube, runner, ns, is_available, "the group Available")
    old = {p["metadata"]["uid"] for p in group(kube, ns)}
    mirror.requests.clear()
    kube.kubectl("patch", "lopadeployment", NAME, "-n", ns, "--type=merge",
                 "-p", json.dumps({"spec": {"restartTrigger": "second-start"}}))
    wait(kube, runner, ns,
         lambda o: is_available(o) and o["status"]["configHash"] != before["status"]["configHash"],
         "the restarted group Available")
    again = group(kube, ns)
    assert not {p["metadata"]["uid"] for p in again} & old  # every pod started anew
    assert mirror.downloads() == []  # the revision was in the cache: not one file fetched
    for log in fetch_logs(runner, ns, again):
        assert "already held in the cache; no download" in log, log


@pytest.mark.parametrize(("uri", "said"), [
    (f"hf://{REPO}@v9", f"revision 'v9' not found in {REPO} at http://"),
    ("hf://lopa-dev/missing", "repository lopa-dev/missing not found at http://"),
])
def test_a_uri_the_hub_cannot_serve_fails_the_fetch_and_the_status_says_why(
    kube: KubeCluster, runner: PodRunner, ns: str, uri: str, said: str
) -> None:
    kube.kubectl("patch", "lopadeployment", NAME, "-n", ns, "--type=merge",
                 "-p", json.dumps({"spec": {"model": {"uri": uri}}}))

    def failed(o: dict[str, Any]) -> bool:
        return said in condition(o, "Progressing").get("message", "")

    final = wait(kube, runner, ns, failed, f"the status to name the failed fetch of {uri}")
    progressing = condition(final, "Progressing")
    assert progressing["reason"] == "ModelFetchFailed", progressing
    assert "init container fetch-model failed (Error, exit code 1: lopa fetch-model: error: " in (
        progressing["message"]), progressing
    assert condition(final, "Available")["status"] == "False"
    (entry,) = final["status"]["groups"]
    assert entry["reason"] == "ModelFetchFailed" and said in entry["message"]
