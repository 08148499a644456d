"""Where a group's pods go: its workers on one node, so the winner's KV broadcast and the step
collectives run over NVLink / HCCS (or shared memory) rather than the network.

spec.placement.sameNode:
  Required   the group's workers must share a node: the first to be scheduled lands anywhere
             (Kubernetes lets a pod that matches its own affinity start the set) and anchors the
             others, so they stay Pending when that node lacks room for them, even if another node
             has it (the default scheduler places pods one by one; a gang scheduler places a group
             whole); the Schedulable condition says so, and deleting the group's worker pods (or a
             new spec.restartTrigger) lets the scheduler choose again
  Preferred  (default) they prefer to: the scheduler packs them when a node has room for them
  None       no preference
The master (no accelerator) only prefers its group's workers' node: requiring it would bind every
worker to wherever the master happened to land, a node without accelerators perhaps. Terms of
spec.affinity are kept; these are added to them.
"""

from __future__ import annotations

import copy
from typing import Any

from . import names

HOSTNAME = "kubernetes.io/hostname"
MODES = ("Required", "Preferred", "None")
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"


def affinity(spec: dict[str, Any], name: str, index: int, role: str) -> dict[str, Any] | None:
    """spec.affinity plus the group's same-node term for a pod of `role`; None when both are empty."""
    out = copy.deepcopy(spec.get("affinity") or {})
    mode = (spec.get("placement") or {}).get("sameNode", "Preferred")
    if mode != "None":
        term = {
            "labelSelector": {"matchLabels": names.labels(name, names.ROLE_WORKER, index)},
            "topologyKey": HOSTNAME,
        }
        # (spec.affinity keeps unknown fields, so a null may stand where a map or list is expected)
        pod_affinity = out["podAffinity"] = out.get("podAffinity") or {}
        if mode == "Required" and role == names.ROLE_WORKER:
            key, entry = REQUIRED, term
        else:
            key, entry = PREFERRED, {"weight": 100, "podAffinityTerm": term}
        pod_affinity[key] = [*(pod_affinity.get(key) or []), entry]
    return out or None


def requires_same_node(pod: dict[str, Any]) -> bool:
    """The pod carries the Required term above (not merely a pod affinity of the user's)."""
    affinity = ((pod.get("spec") or {}).get("affinity") or {}).get("podAffinity") or {}
    for term in affinity.get(REQUIRED) or []:
        selected = (term.get("labelSelector") or {}).get("matchLabels") or {}
        if term.get("topologyKey") == HOSTNAME and names.GROUP_LABEL in selected:
            return True
    return False
