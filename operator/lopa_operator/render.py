"""Pure rendering of a LoPADeployment's children: no cluster access, no owner references.

`children()` is what reconcile applies; unit tests call it directly.
"""

from __future__ import annotations

import copy
from typing import Any

from . import config, names, pods
from . import spec as specs


def config_map(name: str, namespace: str, text: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": names.config_map(name), "namespace": namespace, "labels": names.labels(name)},
        "data": {names.CONFIG_FILE: text},
    }


def worker_service(name: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": names.worker_service(name),
            "namespace": namespace,
            "labels": names.labels(name, names.ROLE_WORKER),
        },
        "spec": {
            "clusterIP": "None",
            # Peers must resolve each other before they are Ready: the rendezvous precedes readiness.
            "publishNotReadyAddresses": True,
            "selector": names.labels(name, names.ROLE_WORKER),
            "ports": [
                {"name": "grpc", "port": names.WORKER_PORT, "targetPort": "grpc", "appProtocol": "grpc"},
                {"name": "rendezvous", "port": names.RENDEZVOUS_PORT, "targetPort": "rendezvous"},
                {"name": "metrics", "port": names.METRICS_PORT, "targetPort": "metrics"},
            ],
        },
    }


def client_service(name: str, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    service = spec["service"]
    metadata: dict[str, Any] = {
        "name": names.client_service(name),
        "namespace": namespace,
        "labels": names.labels(name, names.ROLE_MASTER),
    }
    if service.get("annotations"):
        metadata["annotations"] = dict(service["annotations"])
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "type": service["type"],
            "selector": names.labels(name, names.ROLE_MASTER),
            # The client API only: spec.service.type may be LoadBalancer, and /metrics is not for
            # the outside (master_metrics_service has it, in-cluster).
            "ports": [
                {"name": "grpc", "port": service["port"], "targetPort": "grpc", "appProtocol": "grpc"},
                *([{"name": "http", "port": service["httpPort"], "targetPort": "http", "appProtocol": "http"}]
                  if service.get("httpPort") else []),
            ],
        },
    }


def master_metrics_service(name: str, namespace: str) -> dict[str, Any]:
    """The master's /metrics, cluster-internal (the workers' are on their headless Service)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": names.master_metrics_service(name),
            "namespace": namespace,
            "labels": names.labels(name, names.ROLE_MASTER),
        },
        "spec": {
            "type": "ClusterIP",
            "selector": names.labels(name, names.ROLE_MASTER),
            "ports": [{"name": "metrics", "port": names.METRICS_PORT, "targetPort": "metrics"}],
        },
    }


def worker_statefulset(name: str, namespace: str, spec: dict[str, Any], config_hash: str) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {
            "name": names.worker_set(name),
            "namespace": namespace,
            "labels": names.labels(name, names.ROLE_WORKER),
        },
        "spec": {
            "serviceName": names.worker_service(name),
            "replicas": spec["branchParallelism"],
            # All ranks start together: rank 0 hosts the rendezvous the others wait on.
            "podManagementPolicy": "Parallel",
            # The group rolls as a unit: the operator deletes every stale pod at once.
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": names.labels(name, names.ROLE_WORKER)},
            "template": pods.worker_template(name, spec, config_hash),
        },
    }


def master_deployment(name: str, namespace: str, spec: dict[str, Any], config_hash: str) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": names.master(name),
            "namespace": namespace,
            "labels": names.labels(name, names.ROLE_MASTER),
        },
        "spec": {
            "replicas": 1,
            # Never two masters for one worker group.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": names.labels(name, names.ROLE_MASTER)},
            "template": pods.master_template(name, spec, config_hash),
        },
    }


def group_hash(name: str, namespace: str, spec: dict[str, Any]) -> str:
    """Hash of everything the pods run with: a change means the whole group must restart."""
    text = config.dump(config.render(name, namespace, spec))
    worker = pods.worker_template(name, spec, "")
    master = pods.master_template(name, spec, "")
    trigger = spec.get("restartTrigger")
    # A new restartTrigger value rolls the group like any change (and so clears its restart count);
    # absent, the hash stays what it was before the field existed: no rollout on operator upgrade.
    return config.digest(text, worker, master, trigger) if trigger else config.digest(text, worker, master)


def children(name: str, namespace: str, raw_spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Every child object of LoPADeployment `name`, in apply order (config before its readers)."""
    spec = specs.with_defaults(raw_spec)
    text = config.dump(config.render(name, namespace, spec))
    digest = group_hash(name, namespace, spec)
    objs = [
        config_map(name, namespace, text),
        worker_service(name, namespace),
        worker_statefulset(name, namespace, spec, digest),
        master_deployment(name, namespace, spec, digest),
        client_service(name, namespace, spec),
        master_metrics_service(name, namespace),
    ]
    return [copy.deepcopy(obj) for obj in objs]
