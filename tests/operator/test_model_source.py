"""spec.model.uri and adapterUri (model_source.py) without a cluster: the volumes, mounts and init
containers each kind of URI renders, the paths lopa.yaml names, and an init container's failure in
the status. tests/operator/test_model_uri_run.py runs hf:// end to end."""

from __future__ import annotations

from typing import Any

import yaml

from lopa_operator import model_source, names, render, status
from lopa_operator import spec as specs


def pods(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(worker pod spec, master pod spec, group 0's lopa.yaml)."""
    objs = {f"{o['kind']}/{o['metadata']['name']}": o for o in render.children("d", "ns", spec)}
    worker = objs["StatefulSet/d-0-worker"]["spec"]["template"]["spec"]
    master = objs["Deployment/d-0-master"]["spec"]["template"]["spec"]
    return worker, master, yaml.safe_load(objs["ConfigMap/d-0-config"]["data"][names.CONFIG_FILE])


def mounts(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}


def volumes(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in pod["volumes"]}


HUB = {
    "model": {
        "uri": "hf://Dream-org/Dream-v0-Base-7B@v1",
        "adapterUri": "hf://SJTU-Deng-Lab/D2F_Dream_Base_7B_Lora",
        "huggingFace": {"endpoint": "https://hf-mirror.example", "tokenSecret": {"name": "hf"}},
    }
}


def test_hf_uris_are_fetched_by_init_containers_into_an_emptydir() -> None:
    worker, master, config = pods(HUB)
    assert config["model"]["path"] == "/mnt/models/hf/Dream-org/Dream-v0-Base-7B/v1"
    assert config["model"]["adapter"] == "/mnt/models/hf/SJTU-Deng-Lab/D2F_Dream_Base_7B_Lora/main"
    for pod in (worker, master):  # the master needs the tokenizer files too
        assert volumes(pod)["model-cache"] == {"name": "model-cache", "emptyDir": {}}
        assert mounts(pod)["/mnt/models/hf"]["readOnly"] is True
        fetch, adapter = pod["initContainers"]
        assert [fetch["name"], adapter["name"]] == ["fetch-model", "fetch-adapter"]
        assert fetch["command"] == ["lopa", "fetch-model", "hf://Dream-org/Dream-v0-Base-7B@v1",
                                    "--into", config["model"]["path"]]
        assert adapter["command"][-1] == config["model"]["adapter"]
        env = {e["name"]: e for e in fetch["env"]}
        assert env["HF_ENDPOINT"]["value"] == "https://hf-mirror.example"
        # The kubelet reads the token: the operator never touches the Secret.
        assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}}
        assert env["HOME"]["value"] == "/tmp"  # huggingface_hub's own cache on the writable /tmp
        assert {m["mountPath"]: m.get("readOnly", False) for m in fetch["volumeMounts"]} == {
            "/tmp": False, "/mnt/models/hf": False}
        assert fetch["terminationMessagePolicy"] == "FallbackToLogsOnError"
        assert fetch["securityContext"]["readOnlyRootFilesystem"] is True
        assert fetch["image"] == pod["containers"][0]["image"]
        assert pod["securityContext"]["fsGroup"] == 65532  # every pod's default (security.py), cache or not


def test_a_cache_claim_is_shared_and_writable_by_the_pods_group() -> None:
    spec = {"model": {"uri": "hf://org/m", "cache": {"claimName": "model-cache"}}}
    worker, _, _ = pods(spec)
    assert volumes(worker)["model-cache"]["persistentVolumeClaim"] == {"claimName": "model-cache"}
    assert worker["securityContext"]["fsGroup"] == 65532
    own = pods({**spec, "podSecurityContext": {"fsGroup": 1000}})[0]
    assert own["securityContext"]["fsGroup"] == 1000
    sized = pods({"model": {"uri": "hf://org/m", "cache": {"sizeLimit": "40Gi"}}})[0]
    assert volumes(sized)["model-cache"]["emptyDir"] == {"sizeLimit": "40Gi"}


def test_pvc_uris_mount_their_claims_read_only() -> None:
    spec = {"model": {"uri": "pvc://models/Dream-v0-Base-7B", "adapterUri": "pvc://adapters/d2f/lora"}}
    worker, master, config = pods(spec)
    assert config["model"]["path"] == "/mnt/models/pvc/models/Dream-v0-Base-7B"
    assert config["model"]["adapter"] == "/mnt/models/pvc/adapters/d2f/lora"
    for pod in (worker, master):
        assert "initContainers" not in pod
        claims = {v["persistentVolumeClaim"]["claimName"]: v["persistentVolumeClaim"]
                  for v in pod["volumes"] if "persistentVolumeClaim" in v}
        assert claims == {"adapters": {"claimName": "adapters", "readOnly": True},
                          "models": {"claimName": "models", "readOnly": True}}
        assert mounts(pod)["/mnt/models/pvc/models"]["readOnly"] is True
        assert mounts(pod)["/mnt/models/pvc/adapters"]["readOnly"] is True


def test_a_plain_path_is_used_as_it_is() -> None:
    worker, _, config = pods({"model": {"uri": "/opt/models/dream"}})
    assert config["model"]["path"] == "/opt/models/dream" and config["model"]["adapter"] == ""
    assert "initContainers" not in worker and not [m for m in mounts(worker) if m.startswith("/mnt/models")]


def test_without_a_uri_the_older_fields_render_as_before() -> None:
    spec = {"model": {"pvc": {"claimName": "d2f-models"}, "path": "/models/Dream", "adapter": "/models/lora"}}
    worker, _, config = pods(spec)
    assert config["model"]["path"] == "/models/Dream" and config["model"]["adapter"] == "/models/lora"
    assert volumes(worker)["model"]["persistentVolumeClaim"] == {"claimName": "d2f-models", "readOnly": True}
    assert "initContainers" not in worker
    assert model_source.model_path(specs.with_defaults({})) == ""  # the runtime's bundled model


def test_a_failed_fetch_is_the_groups_message() -> None:
    said = "lopa fetch-model: error: hf://org/m@v9: revision 'v9' not found in org/m at https://hub"
    pod = {"metadata": {"name": "d-0-worker-0", "uid": "u", "labels": {}}, "status": {
        "phase": "Pending",
        "initContainerStatuses": [{
            "name": "fetch-model", "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"exitCode": 1, "reason": "Error",
                                         "message": f"downloading\n{said}\n"}},
        }]}}
    assert status.fetch_failure([pod]) == (
        f"pod d-0-worker-0: init container fetch-model failed (Error, exit code 1: {said})")
    done = {"metadata": {"name": "p"}, "status": {"initContainerStatuses": [
        {"name": "fetch-model", "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}]}}
    assert status.fetch_failure([done]) is None
