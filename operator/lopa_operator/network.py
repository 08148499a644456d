"""The NetworkPolicies that fence each group of a LoPADeployment (spec.networkPolicy, on by default).

Two policies per group, named after what they select (the group's worker StatefulSet and master
Deployment), ingress and egress:
- the workers admit the group's own workers on every port (the collective's data connections open
  ports beyond the rendezvous) and the group's own master on the worker gRPC port; they connect to
  the group's workers only;
- the master admits clients on its client ports (gRPC, the plaintext health port under TLS, HTTP):
  spec.networkPolicy.clientFrom, anyone when it is absent or empty; it connects to its group's
  workers' gRPC port only;
- every pod admits scrapers on the metrics port: spec.networkPolicy.metricsFrom, else the
  operator's default (LOPA_OPERATOR_METRICS_FROM, the chart's networkPolicy.metricsFrom: Prometheus
  pods in any namespace); an empty list admits anyone;
- every pod may resolve names (port 53, UDP and TCP, to any address: the cluster DNS runs where
  the cluster puts it) and reach what spec.networkPolicy.egress adds (say a model store);
- a deployment whose model or adapter is an hf:// URI may also reach the Hub's port (that of
  spec.model.huggingFace.endpoint, else 443) at any address: its init containers download there,
  and a NetworkPolicy cannot tell one container, or one host name, from another.
No other group's pods, of this deployment or another, reach a group's worker or rendezvous ports.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any
from urllib.parse import urlsplit

from . import model_source, names

Obj = dict[str, Any]

# Who scrapes the metrics port unless the operator is told otherwise: Prometheus pods as the
# Prometheus Operator and the prometheus community chart label them, in any namespace.
METRICS_FROM_ENV = "LOPA_OPERATOR_METRICS_FROM"
DEFAULT_METRICS_FROM: list[Obj] = [
    {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
]
DNS_PORT = 53
DEFAULT_HUB = "https://huggingface.co"  # huggingface_hub's endpoint when HF_ENDPOINT is unset
ROLES = (names.ROLE_WORKER, names.ROLE_MASTER)


def _tcp(port: int) -> Obj:
    return {"protocol": "TCP", "port": port}


def _rule(side: str, ports: list[Obj] | None, peers: list[Obj] | None) -> Obj:
    """An ingress (`side` "from") or egress ("to") rule: no peers, any peer; no ports, any port."""
    rule: Obj = {}
    if peers:
        rule[side] = copy.deepcopy(peers)
    if ports is not None:
        rule["ports"] = ports
    return rule


def client_ports(spec: Obj) -> list[int]:
    """The master's container ports clients (and the kubelet's probes) reach."""
    ports = [names.CLIENT_PORT]
    if spec.get("tls"):
        ports.append(names.HEALTH_PORT)
    if (spec.get("service") or {}).get("httpPort"):
        ports.append(names.HTTP_PORT)
    return ports


def default_metrics_from() -> list[Obj]:
    """The operator's scraper peers: LOPA_OPERATOR_METRICS_FROM (a JSON list of NetworkPolicyPeers)
    or DEFAULT_METRICS_FROM. ValueError naming the variable when it is not such a list."""
    text = os.environ.get(METRICS_FROM_ENV, "").strip()
    if not text:
        return copy.deepcopy(DEFAULT_METRICS_FROM)
    try:
        peers = json.loads(text)
    except ValueError as error:
        raise ValueError(f"{METRICS_FROM_ENV} is not JSON: {error}") from None
    if not isinstance(peers, list) or not all(isinstance(p, dict) for p in peers):
        raise ValueError(f"{METRICS_FROM_ENV} must be a JSON list of NetworkPolicyPeer objects, got {text!r}")
    return peers


def metrics_from(spec: Obj) -> list[Obj]:
    fence = spec.get("networkPolicy") or {}
    return fence["metricsFrom"] if "metricsFrom" in fence else default_metrics_from()


def _group(name: str, role: str, index: int) -> Obj:
    return {"podSelector": {"matchLabels": names.labels(name, role, index)}}


def _dns() -> Obj:
    return _rule("to", [{"protocol": proto, "port": DNS_PORT} for proto in ("UDP", "TCP")], None)


def _ingress(name: str, role: str, index: int, spec: Obj) -> list[Obj]:
    fence = spec.get("networkPolicy") or {}
    scrapers = _rule("from", [_tcp(names.METRICS_PORT)], metrics_from(spec))
    if role == names.ROLE_MASTER:
        clients = _rule("from", [_tcp(p) for p in client_ports(spec)], fence.get("clientFrom"))
        return [clients, scrapers]
    return [
        _rule("from", None, [_group(name, names.ROLE_WORKER, index)]),
        _rule("from", [_tcp(names.WORKER_PORT)], [_group(name, names.ROLE_MASTER, index)]),
        scrapers,
    ]


def hub_port(spec: Obj) -> int | None:
    """The port the init containers download hf:// URIs from, None when nothing is fetched."""
    if not any(source.hub for source in model_source.sources(spec).values()):
        return None
    endpoint = urlsplit(((spec.get("model") or {}).get("huggingFace") or {}).get("endpoint") or DEFAULT_HUB)
    return endpoint.port or (80 if endpoint.scheme == "http" else 443)


def _egress(name: str, role: str, index: int, spec: Obj) -> list[Obj]:
    extra = copy.deepcopy((spec.get("networkPolicy") or {}).get("egress") or [])
    workers = [_group(name, names.ROLE_WORKER, index)]
    ports = [_tcp(names.WORKER_PORT)] if role == names.ROLE_MASTER else None
    hub = hub_port(spec)
    fetch = [_rule("to", [_tcp(hub)], None)] if hub is not None else []
    return [_rule("to", ports, workers), _dns(), *fetch, *extra]


def policy(name: str, namespace: str, spec: Obj, index: int, role: str) -> Obj:
    """The NetworkPolicy of group `index`'s `role` pods; `spec` has its defaults applied."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": names.network_policy(name, index, role),
            "namespace": namespace,
            "labels": names.labels(name, role, index),
        },
        "spec": {
            "podSelector": {"matchLabels": names.labels(name, role, index)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": _ingress(name, role, index, spec),
            "egress": _egress(name, role, index, spec),
        },
    }


def policies(name: str, namespace: str, spec: Obj, index: int) -> list[Obj]:
    """Group `index`'s policies: its workers', its master's."""
    return [policy(name, namespace, spec, index, role) for role in ROLES]


def enabled(spec: Obj) -> bool:
    return bool((spec.get("networkPolicy") or {}).get("enabled", True))
