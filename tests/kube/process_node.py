"""The Node object of the process node, and the heartbeat that keeps it Ready.

The node is registered without kwok's annotation (`nodes.KWOK_ANNOTATION`), so kwok leaves it and
its pods alone: only `pod_runner` writes their status. Like a kubelet it registers itself with its
capacity and a Ready condition, and renews its Lease in kube-node-lease every `RENEW_SECONDS`, so
the node lifecycle controller never marks it NotReady (or evicts its pods).

Where it differs from a kubelet: capacity is declared, not measured (and not enforced); node status
is written once, the Lease alone is the heartbeat (a kubelet also refreshes status every few
minutes); there is no kubelet API (`kubectl logs/exec` do not work: `PodRunner.log()` has the logs).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from .kube_api import Api
from .pod_status import now

LEASE_NAMESPACE = "kube-node-lease"
LEASE_SECONDS = 40
RENEW_SECONDS = 10.0
NODE_LABEL = "lopa.dev/process-node"
CAPACITY = {"cpu": "16", "memory": "64Gi", "pods": "110", "ephemeral-storage": "100Gi"}


def _micro_now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def manifest(name: str, address: str) -> dict[str, Any]:
    stamp = now()
    conditions = [
        {"type": kind, "status": "False", "reason": f"Kubelet{reason}", "message": "",
         "lastHeartbeatTime": stamp, "lastTransitionTime": stamp}
        for kind, reason in (("MemoryPressure", "HasSufficientMemory"), ("DiskPressure", "HasNoDiskPressure"),
                             ("PIDPressure", "HasSufficientPID"))
    ] + [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "processes run here",
          "lastHeartbeatTime": stamp, "lastTransitionTime": stamp}]
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                NODE_LABEL: "true",
            },
        },
        "spec": {},
        # Node creation keeps status, as a kubelet's self-registration does.
        "status": {
            "capacity": dict(CAPACITY),
            "allocatable": dict(CAPACITY),
            "conditions": conditions,
            "addresses": [{"type": "InternalIP", "address": address}, {"type": "Hostname", "address": name}],
            "nodeInfo": {"kubeletVersion": "v0.0.0-processes", "operatingSystem": "linux",
                         "architecture": "amd64", "containerRuntimeVersion": "processes://"},
        },
    }


def register(api: Api, name: str, address: str) -> None:
    """Creates the Node (replacing one of that name left by an earlier run) and its Lease."""
    api.delete(f"/api/v1/nodes/{name}")
    node = api.post("/api/v1/nodes", manifest(name, address))
    api.delete(f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{name}")
    api.post(
        f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases",
        {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": name,
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Node", "name": name, "uid": node["metadata"]["uid"]}
                ],
            },
            "spec": {
                "holderIdentity": name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": _micro_now(),
            },
        },
    )


def renew(api: Api, name: str) -> None:
    api.patch(
        f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{name}",
        {"spec": {"renewTime": _micro_now()}},
    )


def unregister(api: Api, name: str) -> None:
    """Deletes the Node (its Lease follows by owner reference; the pod GC removes its pods)."""
    api.delete(f"/api/v1/nodes/{name}")
