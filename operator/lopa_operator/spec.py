"""The LoPADeployment spec with the CRD's defaults applied, plus the accelerator-derived values.

The API server applies the same defaults (the CRD schema); applying them here too keeps the
rendering functions total for partial specs (unit tests, objects created before a CRD upgrade).
tests/operator/test_crd_schema.py checks that both sets of defaults agree.
"""

from __future__ import annotations

import copy
import os
from typing import Any

DEFAULTS: dict[str, Any] = {
    "imagePullPolicy": "IfNotPresent",
    "replicas": 1,
    "branchParallelism": 1,
    "rollout": {"maxUnavailable": 1},
    "placement": {"sameNode": "Preferred"},
    "scheduling": {"gang": "None"},
    "model": {},
    "accelerator": {"type": "cpu", "devicesPerWorker": 1, "shmSize": "8Gi"},
    # No decoding defaults: the keys a spec leaves out stay out of lopa.yaml, so the runtime takes them
    # from the model's lopa_defaults.json (else its own defaults); the CRD has none either.
    "decoding": {},
    "limits": {
        "maxBranches": 15,
        "maxNewTokens": 1024,
        "maxPromptTokens": 2048,
        "queueSize": 64,
        "maxBatch": 8,
        "maxStepTokens": 0,
        "requestTimeoutSeconds": 300,
        "maxModelLen": 0,
    },
    "collective": {"joinTimeoutSeconds": 600, "stepTimeoutSeconds": 60},
    "failurePolicy": {
        "maxGroupRestarts": 5,
        "backoffSeconds": 10,
        "maxBackoffSeconds": 300,
        "resetAfterSeconds": 600,
    },
    "service": {"type": "ClusterIP", "port": 50051},
    "networkPolicy": {"enabled": True},
    "inferencePool": {"enabled": False},
}

BACKENDS = {"nvidia": "nccl", "ascend": "hccl", "cpu": "gloo"}
DEVICES = {"nvidia": "cuda", "ascend": "npu", "cpu": "cpu"}
RESOURCE_NAMES = {"nvidia": "nvidia.com/gpu", "ascend": "huawei.com/Ascend910"}
DEFAULT_IMAGES = {
    "cpu": "ghcr.io/lopa-dev/lopa:0.1.0-cpu",
    "nvidia": "ghcr.io/lopa-dev/lopa:0.1.0-cuda",
    "ascend": "ghcr.io/lopa-dev/lopa:0.1.0-ascend",
}


def merge(defaults: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """`given` over a deep copy of `defaults`: maps merged key by key, anything else replaced."""
    out = copy.deepcopy(defaults)
    for key, value in given.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def with_defaults(spec: dict[str, Any] | None) -> dict[str, Any]:
    """A deep copy of `spec` with every defaulted field filled in."""
    return merge(DEFAULTS, dict(spec or {}))


def accelerator_type(spec: dict[str, Any]) -> str:
    return spec["accelerator"]["type"]


def backend(spec: dict[str, Any]) -> str:
    return spec["accelerator"].get("backend") or BACKENDS[accelerator_type(spec)]


def device(spec: dict[str, Any]) -> str:
    return DEVICES[accelerator_type(spec)]


def resource_name(spec: dict[str, Any]) -> str | None:
    """The extended resource a worker requests, or None on cpu."""
    kind = accelerator_type(spec)
    if kind == "cpu":
        return None
    return spec["accelerator"].get("resourceName") or RESOURCE_NAMES[kind]


def dtype(spec: dict[str, Any]) -> str:
    chosen = spec["model"].get("dtype")
    if chosen:
        return chosen
    return "float32" if accelerator_type(spec) == "cpu" else "bfloat16"


def image(spec: dict[str, Any]) -> str:
    """spec.image, else the operator's default for the accelerator (env LOPA_RUNTIME_IMAGE_<TYPE>)."""
    if spec.get("image"):
        return spec["image"]
    kind = accelerator_type(spec)
    return os.environ.get(f"LOPA_RUNTIME_IMAGE_{kind.upper()}") or DEFAULT_IMAGES[kind]
