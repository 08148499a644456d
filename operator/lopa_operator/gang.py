"""Gang scheduling of a group (spec.scheduling.gang): its master and every worker bound together or
none of them, so that a group never holds accelerators it cannot use.

  Workload  the Workload API of Kubernetes 1.37 (scheduling.k8s.io/v1beta1; the GenericWorkload
            feature gate on the API server and the scheduler): one Workload per deployment with one
            gang template, one PodGroup per group (gang minCount = its pods: workers + master) and
            every pod naming its PodGroup in spec.schedulingGroup. kube-scheduler's GangScheduling
            plugin then binds the group's pods only once all of them fit.
  Kueue     Kueue's StatefulSet integration: the worker StatefulSet carries the queue label, so
            Kueue admits the group's workers as one workload (a serving pod group: replaced pods
            join it) only when the ClusterQueue's quota holds them all, and holds every worker
            behind its scheduling gate until then. The master (no accelerator) is not queued: the
            operator keeps its Deployment at 0 replicas until Kueue first admits the workers, so
            that no pod of a waiting group is bound. Kueue refuses changes of the workers' shape
            (their count, resources, placement) while it manages them.
  None      the default scheduler places pod by pod (a group may be half placed).

spec.scheduling.priorityClassName goes on every pod (and on each PodGroup: the scheduler orders and
preempts gangs by it). A cluster that does not serve what the mode needs (no Workload API, no
LocalQueue of that name) gets no groups: the spec is refused with a message that says so, rather
than groups placed without the gang they asked for.
"""

from __future__ import annotations

import hashlib
from typing import Any

from . import names
from .kube import Kube, KubeError, path
from .ownership import NotServed

NONE, WORKLOAD, KUEUE = "None", "Workload", "Kueue"
WORKLOAD_API = "scheduling.k8s.io/v1beta1"
TEMPLATE = "group"  # the Workload's one pod group template: every group has the same shape
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"  # set on the pods by Kueue: its Workload's name
KUEUE_GATE = "kueue.x-k8s.io/admission"


def mode(spec: dict[str, Any]) -> str:
    return (spec.get("scheduling") or {}).get("gang") or NONE


def group_size(spec: dict[str, Any]) -> int:
    """The pods of one group: its workers and its master."""
    return int(spec["branchParallelism"]) + 1


def _priority(spec: dict[str, Any]) -> str:
    return (spec.get("scheduling") or {}).get("priorityClassName") or ""


def pod_group_name(name: str, index: int, spec: dict[str, Any]) -> str:
    """Group `index`'s PodGroup (Workload mode). Its priority class cannot change: one named for it is
    made anew when it does, beside the old one (which its pods may still name until they roll;
    stale_pod_groups removes it afterwards)."""
    priority = _priority(spec)
    if mode(spec) != WORKLOAD or not priority:
        return names.group(name, index)
    return f"{names.group(name, index)}-{hashlib.sha256(priority.encode()).hexdigest()[:6]}"


def pod_fields(spec: dict[str, Any], name: str, index: int) -> dict[str, Any]:
    """What a group's pod spec carries for its mode: priorityClassName, schedulingGroup."""
    out: dict[str, Any] = {}
    if _priority(spec):
        out["priorityClassName"] = _priority(spec)
    if mode(spec) == WORKLOAD:
        out["schedulingGroup"] = {"podGroupName": pod_group_name(name, index, spec)}
    return out


def owner_labels(spec: dict[str, Any]) -> dict[str, str]:
    """The labels a group's worker StatefulSet carries for its mode: Kueue's queue."""
    if mode(spec) != KUEUE:
        return {}
    return {KUEUE_QUEUE_LABEL: spec["scheduling"]["queueName"]}


def hold_master(
    spec: dict[str, Any], master: dict[str, Any] | None, workers: list[dict[str, Any]]
) -> bool:
    """Kueue mode: the group's master stays at 0 replicas until Kueue first admitted all of its
    workers (none gated); once released, it stays (a group restart gates the new workers again)."""
    if mode(spec) != KUEUE:
        return False
    if master is not None and int(master["spec"].get("replicas") or 0) > 0:
        return False
    live = [p for p in workers if not p["metadata"].get("deletionTimestamp")]
    return len(live) < spec["branchParallelism"] or any(map(gated, live))


def workload(name: str, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The deployment's Workload: the shape of its groups (one gang template)."""
    return {
        "apiVersion": WORKLOAD_API,
        "kind": "Workload",
        "metadata": {"name": name, "namespace": namespace, "labels": names.labels(name)},
        "spec": {
            "controllerRef": {"apiGroup": names.GROUP, "kind": names.KIND, "name": name},
            "podGroupTemplates": [
                {"name": TEMPLATE, "schedulingPolicy": {"gang": {"minCount": group_size(spec)}}}
            ],
        },
    }


def pod_group(name: str, namespace: str, spec: dict[str, Any], index: int) -> dict[str, Any]:
    """Group `index`'s PodGroup: all of its pods or none."""
    body: dict[str, Any] = {
        "workloadRef": {"workloadName": name, "templateName": TEMPLATE},
        "schedulingPolicy": {"gang": {"minCount": group_size(spec)}},
    }
    if _priority(spec):
        body["priorityClassName"] = _priority(spec)
    return {
        "apiVersion": WORKLOAD_API,
        "kind": "PodGroup",
        "metadata": {
            "name": pod_group_name(name, index, spec),
            "namespace": namespace,
            "labels": names.labels(name, index=index),
        },
        "spec": body,
    }


def stale_pod_groups(
    listed: list[dict[str, Any]], wanted: set[str], pods: list[dict[str, Any]]
) -> list[str]:
    """PodGroups of the deployment that no group renders any more and no live pod names."""
    named = {((p.get("spec") or {}).get("schedulingGroup") or {}).get("podGroupName") for p in pods}
    return sorted(g["metadata"]["name"] for g in listed
                  if g["metadata"]["name"] not in wanted and g["metadata"]["name"] not in named)


def explain(error: KubeError, child: dict[str, Any]) -> KubeError:
    """A 404 on the Workload API's kinds: the cluster does not serve it, said so in the user's terms."""
    if error.status == 404 and child["kind"] in ("Workload", "PodGroup") and not isinstance(error, NotServed):
        return NotServed(
            f"spec.scheduling.gang: Workload needs the {WORKLOAD_API} Workload and PodGroup API, which "
            "this cluster does not serve (Kubernetes 1.37+ with the GenericWorkload feature gate on the API "
            f"server and the scheduler, and --runtime-config={WORKLOAD_API}=true): {error.message}"
        )
    return error


def check_queue(kube: Kube, namespace: str, spec: dict[str, Any]) -> None:
    """Kueue mode: the LocalQueue must exist, or Kueue would never see the groups (NotServed)."""
    if mode(spec) != KUEUE:
        return
    queue = spec["scheduling"]["queueName"]
    try:
        found = kube.get(path("LocalQueue", namespace, queue))
    except KubeError as error:
        if error.status != 404:
            raise
        found = None  # the kueue.x-k8s.io API itself is missing
    if found is None:
        raise NotServed(
            f"spec.scheduling.queueName: LocalQueue {namespace}/{queue} not found (gang: Kueue needs Kueue "
            "installed, with its pod integration, and that LocalQueue in the deployment's namespace)"
        )


def kueue_problem(kube: Kube, namespace: str, pods: list[dict[str, Any]]) -> str | None:
    """Why Kueue holds the group of `pods` (its Workload's QuotaReserved=False message), if it says."""
    workload = next((p["metadata"]["labels"][KUEUE_GROUP_LABEL] for p in pods
                     if KUEUE_GROUP_LABEL in (p["metadata"].get("labels") or {})), None)
    if workload is None:
        return None
    try:
        found = kube.get(path("KueueWorkload", namespace, workload))
    except KubeError:
        return None  # no permission or no API: the pods' gate is all there is to report
    for c in ((found or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == "QuotaReserved" and c.get("status") == "False" and c.get("message"):
            return str(c["message"])
    return None


def gated(pod: dict[str, Any]) -> bool:
    """The pod waits behind Kueue's admission gate (not yet released to the scheduler)."""
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    return any(g.get("name") == KUEUE_GATE for g in gates)
