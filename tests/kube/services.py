"""What the cluster says a Service is: its ports and the endpoints the EndpointSlice controller
published for it (from the pods' labels, addresses and Ready conditions that `pod_runner` reports).

`cluster_dns` serves names from this view and `service_proxy` forwards to these endpoints, as
CoreDNS and kube-proxy read Services and EndpointSlices in a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .kube_api import Api

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


@dataclass(frozen=True)
class Endpoint:
    address: str
    hostname: str  # set for a StatefulSet pod whose subdomain is the (headless) Service
    ready: bool
    ports: tuple[tuple[str, int], ...]  # (port name, port) as the EndpointSlice resolved them

    def port(self, name: str) -> int | None:
        return next((port for port_name, port in self.ports if port_name == name), None)


@dataclass
class ServiceView:
    namespace: str
    name: str
    headless: bool
    ports: list[dict[str, Any]]  # the Service's spec.ports
    endpoints: list[Endpoint] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, str]:
        return self.namespace, self.name

    def ready(self) -> list[Endpoint]:
        return [e for e in self.endpoints if e.ready]


def snapshot(api: Api, namespaces: set[str]) -> dict[tuple[str, str], ServiceView]:
    """Every Service of `namespaces` with its endpoints, read in two list calls."""
    views: dict[tuple[str, str], ServiceView] = {}
    for svc in api.items("/api/v1/services"):
        meta, spec = svc["metadata"], svc.get("spec") or {}
        if meta["namespace"] not in namespaces or spec.get("type") == "ExternalName":
            continue
        headless = spec.get("clusterIP") == "None"
        view = ServiceView(meta["namespace"], meta["name"], headless, spec.get("ports") or [])
        views[view.key] = view
    for eps in api.items("/apis/discovery.k8s.io/v1/endpointslices"):
        meta = eps["metadata"]
        owner = (meta["namespace"], (meta.get("labels") or {}).get(SERVICE_NAME_LABEL, ""))
        if owner not in views or eps.get("addressType") != "IPv4":
            continue
        ports = tuple((p.get("name", ""), int(p["port"])) for p in eps.get("ports") or [] if p.get("port"))
        for endpoint in eps.get("endpoints") or []:
            # An absent ready condition means ready (the EndpointSlice API's rule).
            ready = (endpoint.get("conditions") or {}).get("ready") is not False
            for address in endpoint.get("addresses") or []:
                views[owner].endpoints.append(Endpoint(address, endpoint.get("hostname", ""), ready, ports))
    return views
