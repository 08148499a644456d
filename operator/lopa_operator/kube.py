"""A small synchronous Kubernetes REST client that speaks plain dicts.

Credentials come from the kubernetes package's config loaders (in-cluster first, then
KUBECONFIG); requests does the HTTP. Plain dicts keep rendering, status and tests free of
generated model classes.
"""

from __future__ import annotations

import json
from typing import Any

import requests
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

from . import names

# kind -> (API prefix, plural); everything the operator reads or writes.
RESOURCES = {
    "ConfigMap": ("/api/v1", "configmaps"),
    "Service": ("/api/v1", "services"),
    "Pod": ("/api/v1", "pods"),
    "StatefulSet": ("/apis/apps/v1", "statefulsets"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    names.KIND: (f"/apis/{names.API_VERSION}", names.PLURAL),
}
TIMEOUT = (5.0, 30.0)  # connect, read: a stalled API call must not wedge a handler thread


class KubeError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


def path(kind: str, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    prefix, plural = RESOURCES[kind]
    out = f"{prefix}/namespaces/{namespace}/{plural}"
    if name:
        out += f"/{name}"
    if subresource:
        out += f"/{subresource}"
    return out


def load_configuration() -> k8s_client.Configuration:
    cfg = k8s_client.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=cfg)
    except k8s_config.ConfigException:
        k8s_config.load_kube_config(client_configuration=cfg)
    return cfg


class Kube:
    def __init__(self, cfg: k8s_client.Configuration | None = None) -> None:
        self.cfg = cfg or load_configuration()
        self.session = requests.Session()
        # Only the kubeconfig decides TLS and proxies: REQUESTS_CA_BUNDLE or HTTPS_PROXY in the
        # environment would otherwise override the cluster CA (a requests quirk).
        self.session.trust_env = False
        if self.cfg.proxy:
            self.session.proxies = {"https": self.cfg.proxy, "http": self.cfg.proxy}
        self.verify: bool | str = bool(self.cfg.verify_ssl)
        if self.cfg.verify_ssl and self.cfg.ssl_ca_cert:
            self.verify = self.cfg.ssl_ca_cert
        if self.cfg.cert_file and self.cfg.key_file:
            self.session.cert = (self.cfg.cert_file, self.cfg.key_file)

    def _headers(self, content_type: str | None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        # The in-cluster loader refreshes the projected token through this call.
        token = self.cfg.get_api_key_with_prefix("BearerToken", alias="authorization")
        if token:
            headers["Authorization"] = token if token.lower().startswith("bearer ") else f"Bearer {token}"
        return headers

    def request(
        self,
        method: str,
        url_path: str,
        *,
        params: dict[str, str] | None = None,
        body: Any = None,
        content_type: str | None = None,
    ) -> dict[str, Any]:
        data = None if body is None else json.dumps(body)
        if data is not None and content_type is None:
            content_type = "application/json"
        response = self.session.request(
            method,
            self.cfg.host.rstrip("/") + url_path,
            params=params,
            data=data,
            headers=self._headers(content_type),
            timeout=TIMEOUT,
            verify=self.verify,
        )
        if response.status_code >= 400:
            try:
                message = response.json().get("message", response.text)
            except ValueError:
                message = response.text
            raise KubeError(response.status_code, f"{method} {url_path}: {message}")
        return response.json() if response.content else {}

    def get(self, url_path: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", url_path)
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        return self.request("GET", path(kind, namespace), params={"labelSelector": selector}).get("items", [])

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply: creates or updates, and drops fields this manager stopped setting."""
        meta = obj["metadata"]
        return self.request(
            "PATCH",
            path(obj["kind"], meta["namespace"], meta["name"]),
            params={"fieldManager": names.MANAGER, "force": "true"},
            body=obj,
            content_type="application/apply-patch+yaml",
        )

    def delete(self, kind: str, namespace: str, name: str, uid: str | None = None) -> bool:
        """Deletes one object (only that incarnation when `uid` is given); False if already gone."""
        body: dict[str, Any] = {"propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            self.request("DELETE", path(kind, namespace, name), body=body)
        except KubeError as e:
            if e.status in (404, 409):  # gone, or a new pod already took the name
                return False
            raise
        return True

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        return self.request(
            "PATCH",
            path(names.KIND, namespace, name, "status"),
            body={"status": status},
            content_type="application/merge-patch+json",
        )
