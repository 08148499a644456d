"""Accelerator wiring of worker pods: device resources, collective env, shared memory, tolerations."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import spec as specs


@dataclass
class Wiring:
    """What the accelerator adds to the worker pod (and `env` also to the master)."""

    limits: dict[str, str] = field(default_factory=dict)
    env: list[dict[str, Any]] = field(default_factory=list)
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    tolerations: list[dict[str, Any]] = field(default_factory=list)


def _env(name: str, value: object) -> dict[str, Any]:
    return {"name": name, "value": str(value)}


def _device_toleration(resource: str) -> dict[str, Any]:
    # Accelerator nodes are commonly tainted with their resource name (what the
    # ExtendedResourceToleration admission plugin would add when enabled).
    return {"key": resource, "operator": "Exists", "effect": "NoSchedule"}


def nvidia(spec: dict[str, Any]) -> Wiring:
    resource = specs.resource_name(spec) or specs.RESOURCE_NAMES["nvidia"]
    return Wiring(
        limits={resource: str(spec["accelerator"]["devicesPerWorker"])},
        env=[
            # Fail a hung NCCL collective instead of blocking forever (landscape: hung collectives).
            _env("TORCH_NCCL_ASYNC_ERROR_HANDLING", 1),
            _env("NCCL_DEBUG", "WARN"),
        ],
        # NCCL's shared-memory transport outgrows the container runtime's 64Mi /dev/shm.
        volumes=[
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec["accelerator"]["shmSize"]}}
        ],
        mounts=[{"name": "dshm", "mountPath": "/dev/shm"}],
        tolerations=[_device_toleration(resource)],
    )


def ascend(spec: dict[str, Any]) -> Wiring:
    resource = specs.resource_name(spec) or specs.RESOURCE_NAMES["ascend"]
    collective = spec["collective"]
    # HCCL_CONNECT_TIMEOUT must lie in [120, 7200] s; HCCL_EXEC_TIMEOUT bounds one collective.
    connect = min(max(collective["joinTimeoutSeconds"], 120), 7200)
    return Wiring(
        # The Ascend device plugin sets ASCEND_VISIBLE_DEVICES from this request.
        limits={resource: str(spec["accelerator"]["devicesPerWorker"])},
        env=[
            _env("HCCL_CONNECT_TIMEOUT", connect),
            _env("HCCL_EXEC_TIMEOUT", collective["stepTimeoutSeconds"]),
            # HCCL binds its control plane to this address: the pod IP, not the node's.
            {"name": "HCCL_IF_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            _env("HCCL_WHITELIST_DISABLE", 1),
        ],
        tolerations=[_device_toleration(resource)],
    )


def cpu(spec: dict[str, Any]) -> Wiring:
    # gloo runs over TCP between pods: no devices, no shared memory; the backend is in the config.
    return Wiring()


def wiring(spec: dict[str, Any]) -> Wiring:
    return {"nvidia": nvidia, "ascend": ascend, "cpu": cpu}[specs.accelerator_type(spec)](spec)
