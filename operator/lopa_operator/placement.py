"""Where a group's pods go: its workers on one node, so the winner's KV broadcast and the step
collectives run over NVLink / HCCS (or shared memory) rather than the network.

spec.placement.sameNode:
  Required   the group's workers must share a node (the first lands anywhere: Kubernetes lets a pod
             that matches its own affinity start the set); a group larger than any node stays
             Pending, and the Schedulable condition says so
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


def affinity(spec: dict[str, Any], name: str, index: int, role: str) -> dict[str, Any] | None:
    """spec.affinity plus the group's same-node term for a pod of `role`; None when both are empty."""
    out = copy.deepcopy(spec.get("affinity") or {})
    mode = (spec.get("placement") or {}).get("sameNode", "Preferred")
    if mode != "None":
        term = {
            "labelSelector": {"matchLabels": names.labels(name, names.ROLE_WORKER, index)},
            "topologyKey": HOSTNAME,
        }
        pod_affinity = out.setdefault("podAffinity", {})
        if mode == "Required" and role == names.ROLE_WORKER:
            pod_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(term)
        else:
            preferred = {"weight": 100, "podAffinityTerm": term}
            pod_affinity.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append(preferred)
    return out or None
