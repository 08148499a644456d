"""The NetworkPolicy as rendered: who may reach which port of the deployment's pods (no cluster
needed; tests/operator/test_group_secret.py applies it on the API server)."""

from __future__ import annotations

from typing import Any

from lopa_operator import names, network, render
from lopa_operator import spec as specs


def policy(spec: dict[str, Any]) -> dict[str, Any]:
    return network.policy("d", "ns", specs.with_defaults(spec))


def rule_for(rules: list[dict[str, Any]], port: int) -> dict[str, Any]:
    (found,) = [r for r in rules if {"protocol": "TCP", "port": port} in r.get("ports", [])]
    return found


def test_default_policy_fences_the_workers_and_opens_the_client_ports() -> None:
    doc = policy({})
    assert doc["metadata"]["name"] == "d" and doc["spec"]["policyTypes"] == ["Ingress"]
    assert doc["spec"]["podSelector"] == {"matchLabels": names.labels("d")}
    rules = doc["spec"]["ingress"]
    # The deployment's workers reach each other on every port (the collective's data connections).
    workers = {"podSelector": {"matchLabels": names.labels("d", names.ROLE_WORKER)}}
    assert {"from": [workers]} in rules
    masters = {"podSelector": {"matchLabels": names.labels("d", names.ROLE_MASTER)}}
    worker_port = {"from": [masters], "ports": [{"protocol": "TCP", "port": 50052}]}
    assert rule_for(rules, names.WORKER_PORT) == worker_port
    # No rule admits anyone else to the rendezvous or the worker port.
    for rule in rules:
        if "from" not in rule:
            assert {p["port"] for p in rule["ports"]} <= {50051, 50053, 8000, 9090}
    assert "from" not in rule_for(rules, names.CLIENT_PORT)  # clients: anywhere
    assert "from" not in rule_for(rules, names.METRICS_PORT)  # Prometheus: anywhere


def test_client_and_metrics_peers_are_the_users() -> None:
    gateway = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
    prometheus = {"podSelector": {"matchLabels": {"app": "prometheus"}}}
    doc = policy({
        "tls": {"secretName": "t"}, "service": {"httpPort": 443},
        "networkPolicy": {"clientFrom": [gateway], "metricsFrom": [prometheus]},
    })
    rules = doc["spec"]["ingress"]
    client = rule_for(rules, names.CLIENT_PORT)
    assert client["from"] == [gateway]
    assert [p["port"] for p in client["ports"]] == [50051, 50053, 8000]  # container ports, not Service ports
    assert rule_for(rules, names.METRICS_PORT)["from"] == [prometheus]


def test_the_policy_is_a_shared_child_unless_disabled() -> None:
    kinds = [c["kind"] for c in render.shared_children("d", "ns", {})]
    assert kinds.count("NetworkPolicy") == 1
    off = render.shared_children("d", "ns", {"networkPolicy": {"enabled": False}})
    assert "NetworkPolicy" not in [c["kind"] for c in off]
