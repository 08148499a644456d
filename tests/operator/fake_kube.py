"""An in-memory stand-in for the operator's Kube facade (unit tests of reconcile, no cluster).

It stores objects by API path and answers list by label selector. There is no controller:
`settle()` plays the StatefulSet, Deployment and garbage collectors and the kubelet in one step,
creating each missing pod Ready from its owner's template.
"""

from __future__ import annotations

from typing import Any

from lopa_operator import names
from lopa_operator.kube import KubeError, path


class FakeKube:
    """Stores objects by API path; pods are added by the test (there is no controller)."""

    def __init__(self, cr: dict[str, Any]) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.deleted: list[str] = []
        self.reject: tuple[str, int, str] | None = None  # (kind, HTTP status, message) apply fails with
        self.serial = 0  # for pod uids
        self.memo: dict[str, Any] = {}  # the reconciled object's kopf memo
        meta = cr["metadata"]
        self.objects[path(names.KIND, meta["namespace"], meta["name"])] = cr

    @classmethod
    def with_deployment(cls, spec: dict[str, Any]) -> FakeKube:
        """An API holding LoPADeployment ns/d (generation 1) with `spec`."""
        return cls(
            {
                "apiVersion": names.API_VERSION,
                "kind": names.KIND,
                "metadata": {"name": "d", "namespace": "ns", "uid": "cr-uid", "generation": 1},
                "spec": spec,
            }
        )

    def get(self, url: str) -> dict[str, Any] | None:
        return self.objects.get(url)

    def list(self, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        wanted = dict(kv.split("=") for kv in selector.split(","))
        prefix = path(kind, namespace) + "/"
        return [
            o
            for p, o in self.objects.items()
            if p.startswith(prefix) and wanted.items() <= o["metadata"].get("labels", {}).items()
        ]

    def apply(self, obj: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        meta = obj["metadata"]
        if self.reject and obj["kind"] == self.reject[0]:
            raise KubeError(self.reject[1], f"apply {obj['kind']} {meta['name']}: {self.reject[2]}")
        if dry_run:
            return obj
        key = path(obj["kind"], meta["namespace"], meta["name"])
        old = self.objects.get(key)
        if old is None:
            self.serial += 1
        meta["uid"] = old["metadata"]["uid"] if old else f"uid{self.serial}"  # kept across applies
        self.objects[key] = obj
        return obj

    def delete(self, kind: str, namespace: str, name: str, uid: str | None = None) -> bool:
        self.deleted.append(name)
        return self.objects.pop(path(kind, namespace, name), None) is not None

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        cr = self.objects[path(names.KIND, namespace, name)]
        cr["status"] = {k: v for k, v in {**cr.get("status", {}), **status}.items() if v is not None}
        return cr

    def add_pod(self, name: str, uid: str, role: str, template: dict[str, Any], ready: bool = True) -> None:
        self.objects[path("Pod", "ns", name)] = {
            "metadata": {
                "name": name,
                "uid": uid,
                "labels": template["metadata"]["labels"],
                "annotations": template["metadata"]["annotations"],
            },
            "status": {
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                "containerStatuses": [{"restartCount": 0}],
            },
        }

    def of_kind(self, kind: str) -> dict[str, dict[str, Any]]:
        """name -> object of every stored `kind` in namespace ns."""
        prefix = path(kind, "ns") + "/"
        return {p[len(prefix) :]: o for p, o in self.objects.items() if p.startswith(prefix)}

    def settle(self, masters_ready: bool = True) -> None:
        """What the controllers and kubelets would do next: pods of removed owners go, each
        StatefulSet gets its missing ranks, each Deployment one master on its current template."""
        sets, deployments = self.of_kind("StatefulSet"), self.of_kind("Deployment")
        for name in self.of_kind("Pod"):
            owner = name.rsplit("-", 1)[0]
            if owner not in sets and owner not in deployments:
                del self.objects[path("Pod", "ns", name)]
        for name, sts in sets.items():
            for rank in range(sts["spec"]["replicas"]):
                if path("Pod", "ns", f"{name}-{rank}") not in self.objects:
                    self.serial += 1
                    self.add_pod(f"{name}-{rank}", f"uid{self.serial}", "worker", sts["spec"]["template"])
        for name, dep in deployments.items():
            template = dep["spec"]["template"]
            pod = self.objects.get(path("Pod", "ns", f"{name}-x"))
            wanted = template["metadata"]["annotations"]
            if pod is None or pod["metadata"]["annotations"] != wanted:  # Recreate
                self.serial += 1
                self.add_pod(f"{name}-x", f"uid{self.serial}", "master", template, ready=masters_ready)
