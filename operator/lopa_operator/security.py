"""What makes the runtime pods pass the "restricted" Pod Security Standard, and what they write.

By default every master and worker runs as the images' non-root user (65532), with the runtime's
default seccomp profile, no capabilities, no privilege escalation, a read-only root filesystem and
no ServiceAccount token (lopa never calls the API server). Secret volumes are readable by the pod's
user and group only (SECRET_MODE, fsGroup). What a process writes goes to an emptyDir at /tmp: HOME
and the torch / Triton / Hugging Face caches point there.
spec.podSecurityContext and spec.securityContext are merged over these defaults (maps key by key,
a list replaced whole), for accelerators whose device access needs more (docs/guides/security.md,
"Pod security").
"""

from __future__ import annotations

from typing import Any

from . import spec as specs

RUN_AS = 65532  # the USER of every image in docker/
TMP_VOLUME = "tmp"
TMP_DIR = "/tmp"
CACHE_DIR = f"{TMP_DIR}/.cache"

POD_DEFAULTS: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": RUN_AS,
    "runAsGroup": RUN_AS,
    # Secret files are mode SECRET_MODE, owned by root: with fsGroup the kubelet gives them this
    # group (and group read), which every container of the pod holds, whatever its user.
    "fsGroup": RUN_AS,
    # Only a volume whose top directory is not yet the group's is walked (a large model PVC is not
    # re-chowned at every start); Secret, ConfigMap and emptyDir volumes are set up either way.
    "fsGroupChangePolicy": "OnRootMismatch",
    "seccompProfile": {"type": "RuntimeDefault"},
}
# Mode of the Secret volumes' files (the group secret, the link's and the client API's keys): the
# owner (root) only, and the pod's fsGroup through the group bit the kubelet adds (0440 in the pod).
SECRET_MODE = 0o400
CONTAINER_DEFAULTS: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
# Where libraries write when HOME and the root filesystem are not writable.
WRITABLE_ENV = {
    "HOME": TMP_DIR,
    "XDG_CACHE_HOME": CACHE_DIR,
    "TRITON_CACHE_DIR": f"{CACHE_DIR}/triton",
    "TORCHINDUCTOR_CACHE_DIR": f"{CACHE_DIR}/torchinductor",
    "HF_HOME": f"{CACHE_DIR}/huggingface",
}


def pod_context(spec: dict[str, Any]) -> dict[str, Any]:
    return specs.merge(POD_DEFAULTS, spec.get("podSecurityContext") or {})


def container_context(spec: dict[str, Any]) -> dict[str, Any]:
    return specs.merge(CONTAINER_DEFAULTS, spec.get("securityContext") or {})


def env() -> list[dict[str, Any]]:
    return [{"name": k, "value": v} for k, v in WRITABLE_ENV.items()]


def volume() -> dict[str, Any]:
    return {"name": TMP_VOLUME, "emptyDir": {}}


def mount() -> dict[str, Any]:
    return {"name": TMP_VOLUME, "mountPath": TMP_DIR}
