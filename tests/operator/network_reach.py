"""Whether NetworkPolicies let one pod open a connection to a port of another, as the
networking.k8s.io/v1 semantics say (what a network plugin that enforces them does).

A connection is allowed when the destination admits it (no policy of its namespace selects it for
Ingress, or a rule of one that does matches the source and the port) and the source may send it
(likewise for Egress, matching the destination). Peers: podSelector alone means pods of the
policy's namespace; namespaceSelector alone, every pod of the matching namespaces; both, the
matching pods of the matching namespaces; ipBlock, the pods whose IP is in it. A rule's ports match
by protocol (default TCP) and number (or a range to endPort, or the destination's named container
port); no ports, every port. A pod always reaches itself. Traffic from a node (the kubelet's probes)
is always allowed, so it is not modelled.

Pods and policies are API objects (dicts); `namespaces` maps a namespace's name to its labels.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

Obj = dict[str, Any]


def matches(selector: Obj | None, labels: dict[str, str]) -> bool:
    """A LabelSelector against labels; an empty selector matches everything."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, op, values = expression["key"], expression["operator"], expression.get("values") or []
        present = key in labels
        if op == "In" and not (present and labels[key] in values):
            return False
        if op == "NotIn" and present and labels[key] in values:
            return False
        if op == "Exists" and not present:
            return False
        if op == "DoesNotExist" and present:
            return False
    return True


def _labels(obj: Obj) -> dict[str, str]:
    return obj["metadata"].get("labels") or {}


def _namespace(pod: Obj) -> str:
    return str(pod["metadata"]["namespace"])


def _named_port(pod: Obj, name: str) -> int | None:
    for container in pod["spec"].get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == name:
                return int(port["containerPort"])
    return None


@dataclass
class Cluster:
    """The namespaces (name -> labels) and the policies in force."""

    namespaces: dict[str, dict[str, str]]
    policies: list[Obj]

    def namespace_labels(self, name: str) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": name, **self.namespaces.get(name, {})}

    def _peer(self, peer: Obj, policy_namespace: str, pod: Obj) -> bool:
        if "ipBlock" in peer:
            ip = pod.get("status", {}).get("podIP")
            if not ip:
                return False
            block = peer["ipBlock"]
            address = ipaddress.ip_address(ip)
            inside = address in ipaddress.ip_network(block["cidr"], strict=False)
            return inside and not any(address in ipaddress.ip_network(e, strict=False)
                                      for e in block.get("except") or [])
        if "namespaceSelector" in peer:
            if not matches(peer["namespaceSelector"], self.namespace_labels(_namespace(pod))):
                return False
        elif _namespace(pod) != policy_namespace:
            return False
        return matches(peer.get("podSelector"), _labels(pod))

    @staticmethod
    def _port(rule: Obj, target: Obj, port: int, protocol: str) -> bool:
        ports = rule.get("ports") or []
        if not ports:
            return True
        for entry in ports:
            if entry.get("protocol", "TCP") != protocol:
                continue
            wanted = entry.get("port")
            if wanted is None:
                return True
            if isinstance(wanted, str) and not wanted.isdigit():
                if _named_port(target, wanted) == port:
                    return True
                continue
            low = int(wanted)
            if low <= port <= int(entry.get("endPort") or low):
                return True
        return False

    def _selecting(self, pod: Obj, kind: str) -> list[Obj]:
        out = []
        for policy in self.policies:
            spec = policy["spec"]
            types = spec.get("policyTypes") or (["Ingress"] + (["Egress"] if spec.get("egress") else []))
            same = policy["metadata"]["namespace"] == _namespace(pod)
            if same and kind in types and matches(spec.get("podSelector"), _labels(pod)):
                out.append(policy)
        return out

    def _side(self, selected: Obj, other: Obj, kind: str, port: int, protocol: str, target: Obj) -> bool:
        policies = self._selecting(selected, kind)
        if not policies:
            return True
        field, peers_key = ("ingress", "from") if kind == "Ingress" else ("egress", "to")
        for policy in policies:
            home = policy["metadata"]["namespace"]
            for rule in policy["spec"].get(field) or []:
                peers = rule.get(peers_key) or []
                if (not peers or any(self._peer(p, home, other) for p in peers)) and self._port(
                    rule, target, port, protocol
                ):
                    return True
        return False

    def allowed(self, source: Obj, destination: Obj, port: int, protocol: str = "TCP") -> bool:
        if source is destination:
            return True
        ingress = self._side(destination, source, "Ingress", port, protocol, destination)
        egress = self._side(source, destination, "Egress", port, protocol, destination)
        return ingress and egress
