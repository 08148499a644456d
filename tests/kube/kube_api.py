"""A minimal JSON client of the test cluster's API server, for the process-running harness.

Plain dicts over urllib3 with the credentials of a kubeconfig (client certificate or token):
the harness reads and patches pods, nodes, leases, Services and EndpointSlices as a kubelet,
a DNS server and a Service proxy would, without generated model classes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import urllib3
import yaml

TIMEOUT = urllib3.Timeout(connect=5.0, read=30.0)
MERGE_PATCH = "application/merge-patch+json"


class ApiError(RuntimeError):
    def __init__(self, status: int, method: str, path: str, body: str) -> None:
        super().__init__(f"{method} {path}: {status} {body[:500]}")
        self.status = status


class Api:
    """Thread-safe (urllib3 pools connections per host)."""

    def __init__(self, kubeconfig: Path) -> None:
        config = yaml.safe_load(Path(kubeconfig).read_text())
        context = _named(config["contexts"], config["current-context"])["context"]
        cluster = _named(config["clusters"], context["cluster"])["cluster"]
        user = _named(config["users"], context["user"])["user"]
        self.server = cluster["server"].rstrip("/")
        self.headers = {"Accept": "application/json"}
        if user.get("token"):
            self.headers["Authorization"] = f"Bearer {user['token']}"
        # The test cluster's kubeconfigs name files (kube.certs.kubeconfig_dict), never inline data.
        self.pool = urllib3.PoolManager(
            cert_reqs="CERT_REQUIRED",
            ca_certs=cluster["certificate-authority"],
            cert_file=user.get("client-certificate"),
            key_file=user.get("client-key"),
            timeout=TIMEOUT,
            maxsize=8,
        )

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json", **query: Any
    ) -> Any:
        url = self.server + path + (f"?{urlencode(query)}" if query else "")
        headers = dict(self.headers)
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        reply = self.pool.request(method, url, body=data, headers=headers, retries=False)
        if reply.status >= 400:
            raise ApiError(reply.status, method, path, reply.data.decode(errors="replace"))
        return json.loads(reply.data) if reply.data else None

    def get(self, path: str, **query: Any) -> Any:
        """The object, or None when it does not exist."""
        try:
            return self.request("GET", path, **query)
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    def items(self, path: str, **query: Any) -> list[dict[str, Any]]:
        return list((self.request("GET", path, **query) or {}).get("items") or [])

    def post(self, path: str, body: Any) -> Any:
        return self.request("POST", path, body)

    def put(self, path: str, body: Any) -> Any:
        return self.request("PUT", path, body)

    def patch(self, path: str, body: Any) -> Any:
        return self.request("PATCH", path, body, content_type=MERGE_PATCH)

    def delete(self, path: str, body: Any = None) -> Any:
        """Deletes; a missing object (or a stale uid precondition) is not an error."""
        try:
            return self.request("DELETE", path, body)
        except ApiError as error:
            if error.status in (404, 409):
                return None
            raise

    def watch(self, path: str, resource_version: str, seconds: int, **query: Any) -> Iterator[dict[str, Any]]:
        """The watch events of `path` after `resource_version`, for at most `seconds`."""
        query.update(watch="1", resourceVersion=resource_version, timeoutSeconds=str(seconds))
        url = f"{self.server}{path}?{urlencode(query)}"
        reply = self.pool.request("GET", url, headers=self.headers, preload_content=False, retries=False,
                                  timeout=urllib3.Timeout(connect=5.0, read=seconds + 5.0))
        try:
            if reply.status >= 400:
                raise ApiError(reply.status, "WATCH", path, reply.read().decode(errors="replace"))
            buffer = b""
            for chunk in reply.stream(4096):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        yield json.loads(line)
        finally:
            reply.close()  # a watch left early is not drained: its connection is dropped
            reply.release_conn()

    def close(self) -> None:
        self.pool.clear()


def _named(entries: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(e for e in entries if e["name"] == name)

