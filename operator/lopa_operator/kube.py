"""A small synchronous Kubernetes client that speaks plain dicts.

A thin facade over the kubernetes package's dynamic client: credentials come from its config
loaders (in-cluster first, then KUBECONFIG). HTTP is urllib3, which trusts only the CA the
Configuration names (REQUESTS_CA_BUNDLE and friends are ignored, unlike with requests). Plain
dicts keep rendering, status and tests free of generated model classes.
"""

from __future__ import annotations

import json
from typing import Any

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client.rest import ApiException
from kubernetes.dynamic import DynamicClient, Resource, ResourceInstance

from . import names

# kind -> (apiVersion, plural); everything the operator reads or writes.
RESOURCES = {
    "ConfigMap": ("v1", "configmaps"),
    "Secret": ("v1", "secrets"),
    "Service": ("v1", "services"),
    "Pod": ("v1", "pods"),
    "StatefulSet": ("apps/v1", "statefulsets"),
    "Deployment": ("apps/v1", "deployments"),
    "NetworkPolicy": ("networking.k8s.io/v1", "networkpolicies"),
    "InferencePool": ("inference.networking.k8s.io/v1", "inferencepools"),  # Gateway API Inference Extension
    # spec.scheduling.gang: the Workload API (Workload mode); Kueue's queue and workload, read only (Kueue).
    "Workload": ("scheduling.k8s.io/v1beta1", "workloads"),
    "PodGroup": ("scheduling.k8s.io/v1beta1", "podgroups"),
    "LocalQueue": ("kueue.x-k8s.io/v1beta2", "localqueues"),
    "KueueWorkload": ("kueue.x-k8s.io/v1beta2", "workloads"),
    names.KIND: (names.API_VERSION, names.PLURAL),
}
TIMEOUT = (5.0, 30.0)  # connect, read: a stalled API call must not wedge a handler thread


class KubeError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


def resource(kind: str, client: DynamicClient | None = None) -> Resource:
    """The dynamic client's description of `kind`, built from RESOURCES rather than discovered:
    discovery would cost round trips (without our timeout) and share a cache file in /tmp."""
    api_version, plural = RESOURCES[kind]
    group, _, version = api_version.rpartition("/")
    return Resource(
        prefix="apis" if group else "api",
        group=group,
        api_version=version,
        kind=kind,
        name=plural,
        namespaced=True,
        client=client,
        # Only the LoPADeployment's status is written through its subresource.
        subresources={"status": {"kind": kind, "name": f"{plural}/status", "namespaced": True}}
        if kind == names.KIND
        else None,
    )


def path(kind: str, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    out = resource(kind).path(name=name, namespace=namespace)
    return f"{out}/{subresource}" if subresource else out


def load_configuration() -> k8s_client.Configuration:
    cfg = k8s_client.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=cfg)
    except k8s_config.ConfigException:
        k8s_config.load_kube_config(client_configuration=cfg)
    # One attempt per call: kopf retries failed handlers and the timer resyncs, whereas
    # urllib3's default 3 retries would stretch a stall to 4x TIMEOUT.
    cfg.retries = 0
    return cfg


def _as_dict(result: Any) -> dict[str, Any]:
    # An empty response body comes back as a str, not a ResourceInstance.
    return result.to_dict() if isinstance(result, ResourceInstance) else {}


def _no_discovery(client: DynamicClient, cache_file: str | None) -> None:
    """Stands in for DynamicClient's discoverer: every Resource comes from `resource()`."""
    return None


class Kube:
    def __init__(self, cfg: k8s_client.Configuration | None = None) -> None:
        self.cfg = cfg or load_configuration()
        # ApiClient adds the bearer token per request, so the in-cluster loader's refresh hook
        # keeps a rotated projected token working.
        self.client = DynamicClient(k8s_client.ApiClient(self.cfg), discoverer=_no_discovery)
        self.resources = {kind: resource(kind, self.client) for kind in RESOURCES}

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Runs one dynamic-client call with TIMEOUT; API errors become KubeError(status)."""
        try:
            return _as_dict(fn(*args, _request_timeout=TIMEOUT, **kwargs))
        except ApiException as e:
            try:
                message = json.loads(e.body).get("message") or e.body
            except (TypeError, ValueError, AttributeError):
                message = e.body or e.reason
            raise KubeError(e.status, f"{what}: {message}") from e

    def request(
        self,
        method: str,
        url_path: str,
        *,
        params: dict[str, str] | None = None,
        body: Any = None,
        content_type: str | None = None,
    ) -> dict[str, Any]:
        return self._call(
            f"{method} {url_path}",
            self.client.request,
            method,
            url_path,
            body=body,
            query_params=list((params or {}).items()),
            content_type=content_type,
        )

    def get(self, url_path: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", url_path)
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        res = self.resources[kind]
        out = self._call(f"list {kind}", res.get, namespace=namespace, label_selector=selector)
        return out.get("items") or []

    def apply(self, obj: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        """Server-side apply: creates or updates, and drops fields this manager stopped setting.
        With dry_run the API server validates (admission included) and persists nothing."""
        meta = obj["metadata"]
        extra = {"dry_run": "All"} if dry_run else {}
        return self._call(
            f"apply {obj['kind']} {meta['namespace']}/{meta['name']}",
            self.resources[obj["kind"]].server_side_apply,
            body=obj,
            name=meta["name"],
            namespace=meta["namespace"],
            field_manager=names.MANAGER,
            force_conflicts=True,
            **extra,
        )

    def delete(self, kind: str, namespace: str, name: str, uid: str | None = None) -> bool:
        """Deletes one object (only that incarnation when `uid` is given); False if already gone."""
        body: dict[str, Any] = {"propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            self._call(
                f"delete {kind} {namespace}/{name}",
                self.resources[kind].delete,
                name=name,
                namespace=namespace,
                body=body,
            )
        except KubeError as e:
            if e.status in (404, 409):  # gone, or a new pod already took the name
                return False
            raise
        return True

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        return self._call(
            f"patch {names.KIND} {namespace}/{name} status",
            self.resources[names.KIND].status.patch,
            body={"status": status},
            name=name,
            namespace=namespace,
            content_type="application/merge-patch+json",
        )
