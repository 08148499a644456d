"""The runtime pods' security settings as rendered: restricted by default, overrides merged over the
defaults, a writable /tmp for a read-only root (no cluster needed; tests/operator/test_pod_security.py
has the API server's PodSecurity admission judge them)."""

from __future__ import annotations

from typing import Any

import pytest
from test_render import by_kind, sample

from lopa_operator import names, render, security


def pods_of(spec: dict[str, Any], name: str = "d") -> dict[str, dict[str, Any]]:
    """role -> pod spec of group 0."""
    objs = by_kind(render.children(name, "ns", spec))
    return {
        names.ROLE_WORKER: objs[f"StatefulSet/{name}-0-worker"]["spec"]["template"]["spec"],
        names.ROLE_MASTER: objs[f"Deployment/{name}-0-master"]["spec"]["template"]["spec"],
    }


@pytest.mark.parametrize("file", ["cpu.yaml", "nvidia.yaml", "ascend.yaml"])
def test_every_sample_renders_restricted_pods(file: str) -> None:
    cr = sample(file)
    for role, pod in pods_of(cr["spec"], cr["metadata"]["name"]).items():
        assert pod["securityContext"] == {
            "runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
            "fsGroup": 65532, "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"},
        }, role
        assert pod["automountServiceAccountToken"] is False
        assert not any(k in pod for k in ("hostNetwork", "hostPID", "hostIPC"))
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            assert container["securityContext"] == {
                "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]},
            }, (role, container["name"])
        kinds = {k for v in pod["volumes"] for k in v if k != "name"}
        assert kinds <= {"configMap", "secret", "emptyDir", "persistentVolumeClaim"}, role  # restricted's


def test_the_writable_directory_and_the_group_secret_are_mounted() -> None:
    for role, pod in pods_of({"branchParallelism": 2}).items():
        (container,) = pod["containers"]
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes[mounts["/tmp"]["name"]] == {"name": "tmp", "emptyDir": {}}, role
        group = mounts[names.GROUP_DIR]
        assert group["readOnly"] is True
        # Owner-read only; the kubelet adds group read for the pod's fsGroup, which the user holds.
        assert volumes[group["name"]]["secret"] == {"secretName": "d-0-group", "defaultMode": 0o400}
        assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"] == 65532
        env = {e["name"]: e.get("value") for e in container["env"]}
        for key, value in security.WRITABLE_ENV.items():
            assert env[key] == value and value.startswith("/tmp"), (role, key)


def test_every_secret_volume_is_owner_read_only() -> None:
    spec = {"tls": {"secretName": "client-tls"}, "branchParallelism": 2}
    for role, pod in pods_of(spec).items():
        secrets = [v["secret"] for v in pod["volumes"] if "secret" in v]
        assert secrets and all(s["defaultMode"] == 0o400 for s in secrets), role


def test_overrides_merge_over_the_defaults() -> None:
    spec = {
        "podSecurityContext": {"runAsUser": 1000, "supplementalGroups": [1000]},
        "securityContext": {"readOnlyRootFilesystem": False, "capabilities": {"add": ["SYS_PTRACE"]}},
        "env": [{"name": "HOME", "value": "/home/lopa"}],
    }
    for role, pod in pods_of(spec).items():
        assert pod["securityContext"] == {
            "runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 65532, "supplementalGroups": [1000],
            "fsGroup": 65532, "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"},
        }, role
        (container,) = pod["containers"]
        assert container["securityContext"] == {
            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": False,
            "capabilities": {"drop": ["ALL"], "add": ["SYS_PTRACE"]},
        }, role
        assert {e["name"]: e.get("value") for e in container["env"]}["HOME"] == "/home/lopa"


def test_root_on_an_accelerator_is_an_override_away() -> None:
    spec = {
        "accelerator": {"type": "ascend"},
        "podSecurityContext": {"runAsNonRoot": False, "runAsUser": 0, "runAsGroup": 0},
    }
    worker = pods_of(spec)[names.ROLE_WORKER]
    assert worker["securityContext"]["runAsUser"] == 0 and worker["securityContext"]["runAsNonRoot"] is False
    # The rest of the defaults stay unless overridden too.
    assert worker["containers"][0]["securityContext"]["allowPrivilegeEscalation"] is False
