"""The NetworkPolicy that fences a LoPADeployment's pods (spec.networkPolicy, on by default).

One policy per deployment, selecting all its pods (every group's), ingress only:
- from the deployment's workers, every port: the collective's data connections (gloo, NCCL, HCCL)
  use ports beyond the rendezvous; from its masters, the worker gRPC port;
- the masters' client ports (gRPC, the plaintext health port under TLS, HTTP) from
  spec.networkPolicy.clientFrom, or from anywhere when it is empty;
- the metrics port from spec.networkPolicy.metricsFrom, or from anywhere (Prometheus scrapes it).
One object per deployment rather than per group: it does not change when the groups scale, and the
groups of one deployment are told apart by their own secret and CA, not by the network. A worker
of another group of the same deployment can reach a worker's port; its calls are refused
(UNAUTHENTICATED) without the group's secret.
"""

from __future__ import annotations

import copy
from typing import Any

from . import names


def _tcp(port: int) -> dict[str, Any]:
    return {"protocol": "TCP", "port": port}


def _rule(ports: list[int] | None, peers: list[dict[str, Any]] | None) -> dict[str, Any]:
    rule: dict[str, Any] = {}
    if peers:  # none: from anywhere
        rule["from"] = copy.deepcopy(peers)
    if ports is not None:  # none: every port
        rule["ports"] = [_tcp(p) for p in ports]
    return rule


def client_ports(spec: dict[str, Any]) -> list[int]:
    """The master's container ports clients (and the kubelet's probes) reach."""
    ports = [names.CLIENT_PORT]
    if spec.get("tls"):
        ports.append(names.HEALTH_PORT)
    if (spec.get("service") or {}).get("httpPort"):
        ports.append(names.HTTP_PORT)
    return ports


def policy(name: str, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The deployment's NetworkPolicy; `spec` has its defaults applied."""
    fence = spec.get("networkPolicy") or {}
    workers = {"podSelector": {"matchLabels": names.labels(name, names.ROLE_WORKER)}}
    masters = {"podSelector": {"matchLabels": names.labels(name, names.ROLE_MASTER)}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": names.network_policy(name),
            "namespace": namespace,
            "labels": names.labels(name),
        },
        "spec": {
            "podSelector": {"matchLabels": names.labels(name)},
            "policyTypes": ["Ingress"],
            "ingress": [
                _rule(None, [workers]),
                _rule([names.WORKER_PORT], [masters]),
                _rule(client_ports(spec), fence.get("clientFrom")),
                _rule([names.METRICS_PORT], fence.get("metricsFrom")),
            ],
        },
    }


def enabled(spec: dict[str, Any]) -> bool:
    return bool((spec.get("networkPolicy") or {}).get("enabled", True))
