"""Names, labels and well-known constants shared by rendering, reconcile and status."""

from __future__ import annotations

GROUP = "lopa.dev"
VERSION = "v1alpha1"
PLURAL = "lopadeployments"
KIND = "LoPADeployment"
API_VERSION = f"{GROUP}/{VERSION}"

MANAGER = "lopa-operator"  # field manager of server-side apply and app.kubernetes.io/managed-by
CONFIG_FILE = "lopa.yaml"
CONFIG_DIR = "/etc/lopa"
TLS_DIR = "/etc/lopa/tls"

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

ROLE_WORKER = "worker"
ROLE_MASTER = "master"


def config_map(name: str) -> str:
    return f"{name}-config"


def worker_set(name: str) -> str:
    return f"{name}-worker"


def worker_service(name: str) -> str:
    return f"{name}-workers"


def master(name: str) -> str:
    return f"{name}-master"


def client_service(name: str) -> str:
    return name


def master_metrics_service(name: str) -> str:
    return f"{master(name)}-metrics"


def worker_pod(name: str, rank: int) -> str:
    return f"{worker_set(name)}-{rank}"


def worker_host(name: str, namespace: str, rank: int) -> str:
    """Stable DNS name of worker `rank` through the headless Service."""
    return f"{worker_pod(name, rank)}.{worker_service(name)}.{namespace}.svc"


def labels(name: str, role: str | None = None) -> dict[str, str]:
    """Labels of every child; with `role` they select the master or the worker pods."""
    out = {
        "app.kubernetes.io/name": "lopa",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/managed-by": MANAGER,
    }
    if role:
        out["app.kubernetes.io/component"] = role
    return out


def selector(name: str, role: str) -> str:
    return ",".join(f"{k}={v}" for k, v in labels(name, role).items())
