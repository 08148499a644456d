"""Names, labels and well-known constants shared by rendering, reconcile and status."""

from __future__ import annotations

from typing import Any

GROUP = "lopa.dev"
VERSION = "v1alpha1"
PLURAL = "lopadeployments"
KIND = "LoPADeployment"
API_VERSION = f"{GROUP}/{VERSION}"

MANAGER = "lopa-operator"  # field manager of server-side apply and app.kubernetes.io/managed-by
CONFIG_FILE = "lopa.yaml"
CONFIG_DIR = "/etc/lopa"
TLS_DIR = "/etc/lopa/tls"
GROUP_DIR = "/etc/lopa/group"  # the group Secret: the link's shared secret and mutual TLS files
CLUSTER_DOMAIN = "cluster.local"

# The pod contract of docs/design (architecture.md "Processes and the pod contract").
CLIENT_PORT = 50051
WORKER_PORT = 50052
RENDEZVOUS_PORT = 29500
METRICS_PORT = 9090
# With spec.tls: the master's plaintext grpc.health.v1 (master.health_port), for the kubelet's probe.
HEALTH_PORT = 50053
HTTP_PORT = 8000  # the master's OpenAI-compatible HTTP API (spec.service.httpPort enables it)

CONFIG_HASH_ANNOTATION = f"{GROUP}/config-hash"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
# On pod templates: a hash of the group Secret's data (a group restarts when its Secret is made again).
SECRET_HASH_ANNOTATION = f"{GROUP}/group-secret-hash"
# On a group Secret: the spec.restartTrigger it was made for (a new trigger makes it again).
TRIGGER_ANNOTATION = f"{GROUP}/restart-trigger"

ROLE_WORKER = "worker"
ROLE_MASTER = "master"


GROUP_LABEL = f"{GROUP}/group"  # the index of the group (spec.replicas) a pod or child belongs to


# One LoPADeployment runs spec.replicas groups; group `index` owns its config, master and workers.
# Shared by every group: the workers' headless Service (DNS of each worker pod), the client Service
# (spanning every ready master) and the masters' metrics Service.


def group(name: str, index: int) -> str:
    return f"{name}-{index}"


def config_map(name: str, index: int) -> str:
    return f"{group(name, index)}-config"


def group_secret(name: str, index: int) -> str:
    return f"{group(name, index)}-group"


def worker_set(name: str, index: int) -> str:
    return f"{group(name, index)}-worker"


def master(name: str, index: int) -> str:
    return f"{group(name, index)}-master"


def worker_pod(name: str, index: int, rank: int) -> str:
    return f"{worker_set(name, index)}-{rank}"


def worker_service(name: str) -> str:
    return f"{name}-workers"


def client_service(name: str) -> str:
    return name


def master_metrics_service(name: str) -> str:
    return f"{name}-master-metrics"


def network_policy(name: str, index: int, role: str) -> str:
    """The NetworkPolicy of group `index`'s `role` pods: named as the StatefulSet or Deployment
    whose pods it selects."""
    return worker_set(name, index) if role == ROLE_WORKER else master(name, index)


def deployment_network_policy(name: str) -> str:
    """A policy of the deployment's own name, fencing all its groups at once (what operator versions
    without per-group policies made): deleted when this LoPADeployment controls it, as it would admit
    every group's workers to every other group's ports."""
    return name


def inference_pool(name: str) -> str:
    return name


def worker_host(name: str, namespace: str, index: int, rank: int) -> str:
    """Stable DNS name of worker `rank` of group `index` through the headless Service."""
    return f"{worker_pod(name, index, rank)}.{worker_service(name)}.{namespace}.svc"


def labels(name: str, role: str | None = None, index: int | None = None) -> dict[str, str]:
    """Labels of every child; with `role` they select the master or the worker pods (of every
    group), with `index` too those of one group."""
    out = {
        "app.kubernetes.io/name": "lopa",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/managed-by": MANAGER,
    }
    if role:
        out["app.kubernetes.io/component"] = role
    if index is not None:
        out[GROUP_LABEL] = str(index)
    return out


# What llm-d's and the inference gateway's tooling select model-server pods on: the masters serve the
# whole request (prefill and decode: role "both") under the model name clients ask for (the
# LoPADeployment's, as the OpenAI API names it); the workers carry the model only.
LLMD_SERVING_LABEL = "llm-d.ai/inferenceServing"
LLMD_MODEL_LABEL = "llm-d.ai/model"
LLMD_ROLE_LABEL = "llm-d.ai/role"


def serving_labels(name: str, role: str) -> dict[str, str]:
    """The llm-d labels of a pod of `role` (README: Kubernetes labels)."""
    if role == ROLE_MASTER:
        return {LLMD_SERVING_LABEL: "true", LLMD_MODEL_LABEL: name, LLMD_ROLE_LABEL: "both"}
    return {LLMD_MODEL_LABEL: name}


def selector(name: str, role: str | None = None, index: int | None = None) -> str:
    return ",".join(f"{k}={v}" for k, v in labels(name, role, index).items())


def group_of(obj: dict[str, Any]) -> int | None:
    """The group index of a child or pod, None for a shared child (or one from before groups)."""
    value = (obj.get("metadata", {}).get("labels") or {}).get(GROUP_LABEL, "")
    return int(value) if value.isdigit() else None
