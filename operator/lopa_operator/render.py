"""Pure rendering of a LoPADeployment's children: no cluster access, no owner references.

Shared children (the Services) serve every group; each group `index` < spec.replicas has its own
Secret, ConfigMap, worker StatefulSet and master Deployment (`group_children`), and NetworkPolicies
(rendered with the shared children). reconcile applies the shared ones and the groups the rollout
lets change, each with the Secret data it keeps (credentials.py); `children()` renders them all,
with fresh secrets (unit tests, --render).
"""

from __future__ import annotations

import copy
from typing import Any

from . import config, credentials, gang, names, network, pods
from . import spec as specs


def config_map(name: str, namespace: str, index: int, text: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": names.config_map(name, index),
            "namespace": namespace,
            "labels": names.labels(name, index=index),
        },
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
                *(
                    [
                        {
                            "name": "http",
                            "port": service["httpPort"],
                            "targetPort": "http",
                            "appProtocol": "http",
                        }
                    ]
                    if service.get("httpPort")
                    else []
                ),
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


def worker_statefulset(
    name: str, namespace: str, spec: dict[str, Any], config_hash: str, index: int, secret_hash: str = ""
) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {
            "name": names.worker_set(name, index),
            "namespace": namespace,
            "labels": {**names.labels(name, names.ROLE_WORKER, index), **gang.owner_labels(spec)},
        },
        "spec": {
            "serviceName": names.worker_service(name),
            "replicas": spec["branchParallelism"],
            # All ranks start together: rank 0 hosts the rendezvous the others wait on.
            "podManagementPolicy": "Parallel",
            # The group rolls as a unit: the operator deletes every stale pod at once.
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": names.labels(name, names.ROLE_WORKER, index)},
            "template": pods.worker_template(name, spec, config_hash, index, secret_hash),
        },
    }


def master_deployment(
    name: str, namespace: str, spec: dict[str, Any], config_hash: str, index: int, secret_hash: str = "",
    held: bool = False,
) -> dict[str, Any]:
    """`held`: at 0 replicas, until Kueue admits the group's workers (gang.hold_master)."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": names.master(name, index),
            "namespace": namespace,
            "labels": names.labels(name, names.ROLE_MASTER, index),
        },
        "spec": {
            "replicas": 0 if held else 1,
            # Never two masters for one worker group.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": names.labels(name, names.ROLE_MASTER, index)},
            "template": pods.master_template(name, spec, config_hash, index, secret_hash),
        },
    }


def group_hash(name: str, namespace: str, spec: dict[str, Any]) -> str:
    """Hash of everything a group's pods run with: a change means every group must roll. Groups
    differ only by their index, so group 0's rendering stands for all: one hash per spec."""
    text = config.dump(config.render(name, namespace, spec, 0))
    worker = pods.worker_template(name, spec, "", 0)
    master = pods.master_template(name, spec, "", 0)
    trigger = spec.get("restartTrigger")
    # A new restartTrigger value rolls the groups like any change (and so clears their restart
    # counts); absent, it adds nothing to the hash.
    return config.digest(text, worker, master, trigger) if trigger else config.digest(text, worker, master)


def shared_children(name: str, namespace: str, raw_spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The Services every group shares, each group's NetworkPolicies (spec.networkPolicy.enabled) and
    the Workload (spec.scheduling.gang: Workload): they depend on the group's index alone, so they are
    applied whatever the group's turn in a roll."""
    spec = specs.with_defaults(raw_spec)
    objs = [
        worker_service(name, namespace),
        client_service(name, namespace, spec),
        master_metrics_service(name, namespace),
    ]
    if network.enabled(spec):
        for index in range(spec["replicas"]):
            objs += network.policies(name, namespace, spec, index)
    if gang.mode(spec) == gang.WORKLOAD:
        objs.append(gang.workload(name, namespace, spec))
    return [copy.deepcopy(obj) for obj in objs]


def group_children(
    name: str, namespace: str, raw_spec: dict[str, Any], index: int, secret: credentials.Data | None = None,
    hold_master: bool = False,
) -> list[dict[str, Any]]:
    """Group `index`'s Secret (`secret`: its data; None: fresh), ConfigMap, PodGroup (gang Workload),
    worker StatefulSet and master Deployment (what the pods mount or name before the pods);
    `hold_master`: the master at 0 replicas (gang.hold_master)."""
    spec = specs.with_defaults(raw_spec)
    if secret is None:
        secret = credentials.fresh(name, namespace, index, bool(spec.get("tls")))
    text = config.dump(config.render(name, namespace, spec, index))
    digest = group_hash(name, namespace, spec)
    secret_hash = credentials.digest(secret)
    objs = [
        credentials.secret(name, namespace, index, secret, spec),
        config_map(name, namespace, index, text),
        *([gang.pod_group(name, namespace, spec, index)] if gang.mode(spec) == gang.WORKLOAD else []),
        worker_statefulset(name, namespace, spec, digest, index, secret_hash),
        master_deployment(name, namespace, spec, digest, index, secret_hash, hold_master),
    ]
    return [copy.deepcopy(obj) for obj in objs]


def children(name: str, namespace: str, raw_spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Every child of LoPADeployment `name` at its spec, every group included (fresh secrets), in
    apply order. The InferencePool (spec.inferencePool) is not among them: inference_pool.py."""
    replicas = specs.with_defaults(raw_spec)["replicas"]
    groups = [obj for index in range(replicas) for obj in group_children(name, namespace, raw_spec, index)]
    return groups + shared_children(name, namespace, raw_spec)
