"""Where a group's pods go: its workers on one node, or in one topology domain (a rack, a zone), so
the winner's KV broadcast and the step collectives run over NVLink / HCCS (or a short network path)
rather than across the cluster.

spec.placement.sameNode:
  Required   the group's workers must share a node: the first to be scheduled lands anywhere
             (Kubernetes lets a pod that matches its own affinity start the set) and anchors the
             others, so they stay Pending when that node lacks room for them, even if another node
             has it (the default scheduler places pods one by one; with spec.scheduling.gang the
             group is placed whole, where it fits, or not at all); the Schedulable condition says
             so, and deleting the group's worker pods (or a new spec.restartTrigger) lets the
             scheduler choose again
  Preferred  (default) they prefer to: the scheduler packs them when a node has room for them
  None       no preference
spec.placement.topology {key, mode}: the same for the domain of a node label (`key`:
topology.kubernetes.io/zone, a rack label, ...), Required (default) or Preferred, beside sameNode.
The master (no accelerator) only prefers its group's workers' node or domain: requiring it would
bind every worker to wherever the master happened to land, a node without accelerators perhaps.
Terms of spec.affinity are kept; these are added to them.
"""

from __future__ import annotations

import copy
from typing import Any

from . import names

HOSTNAME = "kubernetes.io/hostname"
MODES = ("Required", "Preferred", "None")
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"


def domains(spec: dict[str, Any]) -> list[tuple[str, str]]:
    """(topology key, mode) of every co-location the spec asks of a group's workers."""
    chosen = spec.get("placement") or {}
    out = []
    same = chosen.get("sameNode", "Preferred")
    if same != "None":
        out.append((HOSTNAME, same))
    topology = chosen.get("topology")
    if topology and (topology["key"], topology.get("mode", "Required")) not in out:
        out.append((topology["key"], topology.get("mode", "Required")))
    return out


def affinity(spec: dict[str, Any], name: str, index: int, role: str) -> dict[str, Any] | None:
    """spec.affinity plus the group's co-location terms for a pod of `role`; None when both are empty."""
    out = copy.deepcopy(spec.get("affinity") or {})
    for key, mode in domains(spec):
        workers = names.labels(name, names.ROLE_WORKER, index)
        term = {"labelSelector": {"matchLabels": workers}, "topologyKey": key}
        # (spec.affinity keeps unknown fields, so a null may stand where a map or list is expected)
        pod_affinity = out["podAffinity"] = out.get("podAffinity") or {}
        if mode == "Required" and role == names.ROLE_WORKER:
            field, entry = REQUIRED, term
        else:
            field, entry = PREFERRED, {"weight": 100, "podAffinityTerm": term}
        pod_affinity[field] = [*(pod_affinity.get(field) or []), entry]
    return out or None


def required_domain(pod: dict[str, Any]) -> str | None:
    """The topology key of the first group term above the pod must satisfy (not merely a pod
    affinity of the user's), or None."""
    affinity = ((pod.get("spec") or {}).get("affinity") or {}).get("podAffinity") or {}
    for term in affinity.get(REQUIRED) or []:
        selected = (term.get("labelSelector") or {}).get("matchLabels") or {}
        if names.GROUP_LABEL in selected:
            return str(term.get("topologyKey"))
    return None


def requires_same_node(pod: dict[str, Any]) -> bool:
    """The pod carries the sameNode: Required term."""
    affinity = ((pod.get("spec") or {}).get("affinity") or {}).get("podAffinity") or {}
    return any(
        term.get("topologyKey") == HOSTNAME and names.GROUP_LABEL in ((term.get("labelSelector") or {})
                                                                     .get("matchLabels") or {})
        for term in affinity.get(REQUIRED) or []
    )
