"""Which groups take the current spec now: the rollout, as a pure function of what is deployed.

A LoPADeployment runs spec.replicas independent groups. A spec change replaces a group as a unit
(its master and every worker), so it rolls group by group: at most spec.rollout.maxUnavailable
groups are down at once, counting those already down for any reason (forming, restarting, lost).
A stale group that is down anyway rolls at once (replacing it costs no capacity). Groups at or
beyond spec.replicas are removed, highest index first as a StatefulSet scales.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from . import group, names
from .status import pod_ready

Obj = dict[str, Any]


@dataclass(frozen=True)
class Deployed:
    """A group as it exists in the cluster."""

    index: int
    worker_hash: str | None  # the config hash its worker StatefulSet's pod template carries
    master_hash: str | None  # and its master Deployment's (None: the child is missing)
    workers: int  # its StatefulSet's replicas: the world size it runs with
    available: bool  # formed, every worker and the master Ready (status.groups[].available)

    def runs(self, config_hash: str) -> bool:
        return self.worker_hash == config_hash and self.master_hash == config_hash


@dataclass(frozen=True)
class Plan:
    update: tuple[int, ...]  # groups rendered at the current spec now: new, current or rolling
    hold: tuple[int, ...]  # stale groups that keep what they run until their turn
    remove: tuple[int, ...]  # groups beyond spec.replicas: their children are deleted


def plan(deployed: Mapping[int, Deployed], replicas: int, desired: str, max_unavailable: int) -> Plan:
    wanted = range(replicas)
    stale = [i for i in wanted if i in deployed and not deployed[i].runs(desired)]
    down = sum(1 for i in wanted if i not in deployed or not deployed[i].available)
    rolling = [i for i in stale if not deployed[i].available]  # down already: free to replace
    for i in stale:
        if deployed[i].available and down < max_unavailable:
            rolling.append(i)
            down += 1
    hold = tuple(i for i in stale if i not in rolling)
    return Plan(
        update=tuple(i for i in wanted if i not in hold),
        hold=hold,
        remove=tuple(sorted((i for i in deployed if i >= replicas), reverse=True)),
    )


def hold_deployed(plan: Plan, deployed: Mapping[int, Deployed]) -> Plan:
    """The plan while the API server refuses the current spec: nothing of it was applied, so every
    deployed group keeps what it runs (and is still looked after), and no group is removed."""
    wanted = plan.update + plan.hold
    return Plan(
        update=tuple(i for i in wanted if i not in deployed),
        hold=tuple(sorted(i for i in wanted if i in deployed)),
        remove=(),
    )


def _template_hash(obj: Obj | None) -> str | None:
    if obj is None:
        return None
    template = obj.get("spec", {}).get("template", {}).get("metadata", {})
    return (template.get("annotations") or {}).get(names.CONFIG_HASH_ANNOTATION)


def deployed_groups(
    worker_sets: Iterable[Obj], masters: Iterable[Obj], entries: Mapping[int, Obj], pods: list[Obj]
) -> dict[int, Deployed]:
    """Every group that has a worker StatefulSet or a master Deployment, by index; `entries` are
    the groups' status.groups[] entries, `pods` the deployment's pods."""
    by_set = {i: s for s in worker_sets if (i := names.group_of(s)) is not None}
    by_master = {i: m for m in masters if (i := names.group_of(m)) is not None}
    out = {}
    for i in sorted(by_set.keys() | by_master.keys()):
        worker_set = by_set.get(i)
        found = Deployed(
            index=i,
            worker_hash=_template_hash(worker_set),
            master_hash=_template_hash(by_master.get(i)),
            workers=int(worker_set["spec"].get("replicas") or 0) if worker_set else 0,
            available=False,
        )
        mine = [p for p in pods if names.group_of(p) == i]
        out[i] = replace(found, available=serving_now(entries.get(i) or {}, mine, found))
    return out


def unexpected(children: Iterable[Obj], replicas: int, legacy_too: bool) -> list[Obj]:
    """Children that no group in spec.replicas owns: of removed groups, and (with `legacy_too`)
    those without a group label, rendered by an operator from before groups existed: they keep
    serving until enough new groups do. Shared Services are never listed here."""
    return [
        c
        for c in children
        if ((i := names.group_of(c)) is None and legacy_too) or (i is not None and i >= replicas)
    ]


def serving_now(entry: Obj, pods: Iterable[Obj], deployed: Deployed) -> bool:
    """What the last status said of a group, re-checked against its live pods: the status may be
    a resync old, or from a reconcile that stopped before writing it. Up = the status says so for
    the hash it runs, its formed members are all there and Ready on it, and so is a master."""
    config_hash = deployed.worker_hash
    if not entry.get("available") or not config_hash or entry.get("configHash") != config_hash:
        return False
    if not deployed.runs(config_hash):
        return False
    live = [p for p in pods if not group.is_terminating(p) and group.config_hash(p) == config_hash]
    role = "app.kubernetes.io/component"
    workers = [p for p in live if p["metadata"]["labels"].get(role) == names.ROLE_WORKER and pod_ready(p)]
    members = {m.get("uid") for m in entry.get("members") or []}
    if len(workers) != deployed.workers or {p["metadata"]["uid"] for p in workers} != members:
        return False
    return any(p["metadata"]["labels"].get(role) == names.ROLE_MASTER and pod_ready(p) for p in live)


def held_state(deployed: Deployed) -> tuple[str, int]:
    """(config hash, worker count) a held group keeps being checked against."""
    return deployed.worker_hash or "", deployed.workers
