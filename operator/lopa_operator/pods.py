"""Pod templates of the two roles (the pod contract of architecture.md), as plain dicts."""

from __future__ import annotations

import copy
from typing import Any

from . import accelerators, gang, model_source, names, placement, security
from . import spec as specs

CONFIG_VOLUME = "config"
TLS_VOLUME = "tls"
GROUP_VOLUME = "group"
# A container that exits with an error leaves its log's tail as its termination message: a lopa
# process's last line names what stopped it ("lopa worker: error: limits.max_step_tokens: ..."),
# which the group's restart reason and event then carry (group.exit_reason).
TERMINATION_MESSAGE = "FallbackToLogsOnError"


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _config_volume(name: str, index: int) -> dict[str, Any]:
    return {"name": CONFIG_VOLUME, "configMap": {"name": names.config_map(name, index)}}


def _secret_source(secret_name: str) -> dict[str, Any]:
    return {"secretName": secret_name, "defaultMode": security.SECRET_MODE}


def _group_volumes(name: str, index: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """What every pod of group `index` mounts beside its config: the group Secret (read-only) and
    the writable emptyDir (the root filesystem is read-only)."""
    volumes = [
        {"name": GROUP_VOLUME, "secret": _secret_source(names.group_secret(name, index))},
        security.volume(),
    ]
    mounts = [
        {"name": CONFIG_VOLUME, "mountPath": names.CONFIG_DIR, "readOnly": True},
        {"name": GROUP_VOLUME, "mountPath": names.GROUP_DIR, "readOnly": True},
        security.mount(),
    ]
    return [_config_volume(name, index), *volumes], mounts


def _merge_env(ours: list[dict[str, Any]], user: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The operator's env with spec.env merged in by name (one entry per name: server-side apply
    refuses duplicate keys). A user entry replaces the operator's default in place, or is appended;
    of duplicate user entries the last wins. The LOPA_* variables the operator sets here (rank, world
    size, pod identity) are not the user's to change: the CRD refuses them (a CEL rule on spec.env),
    and an entry that got past it is dropped here."""
    out = copy.deepcopy(ours)
    owned = {e["name"] for e in ours if e["name"].startswith("LOPA_")}
    index = {e["name"]: i for i, e in enumerate(out)}
    for entry in user or []:
        name = entry["name"]
        if name in owned:
            continue
        if name in index:
            out[index[name]] = copy.deepcopy(entry)
        else:
            index[name] = len(out)
            out.append(copy.deepcopy(entry))
    return out


def _resources(base: dict[str, Any] | None, limits: dict[str, str]) -> dict[str, Any]:
    """User resources plus accelerator limits (extended resources need requests == limits)."""
    out = copy.deepcopy(base or {})
    if limits:
        out.setdefault("limits", {}).update(limits)
        out.setdefault("requests", {}).update(limits)
    return out


DRAIN_MARGIN_S = 15  # beyond the longest request: the workers' quiet period, process exit
# A deleted master keeps admitting for this long before SIGTERM: the endpoints controller and the
# Service proxies drop it meanwhile, so new requests go to other groups instead of being refused.
PRE_STOP_SLEEP_S = 5


def _common_pod_spec(
    spec: dict[str, Any], tolerations: list[dict[str, Any]], name: str, index: int
) -> dict[str, Any]:
    # On SIGTERM the master drains (no new request; queued and running ones finish, at most
    # limits.requestTimeoutSeconds) and the workers serve its steps until it goes quiet: the grace
    # period covers that, so a rollout or scale-down loses no request in flight.
    limits = {**specs.DEFAULTS["limits"], **(spec.get("limits") or {})}
    grace = PRE_STOP_SLEEP_S + limits["requestTimeoutSeconds"] + DRAIN_MARGIN_S
    pod: dict[str, Any] = {
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": grace,
        # The pause process is PID 1, not lopa: a container's PID 1 ignores every signal it has no
        # handler for, and a worker keeps SIGTERM's default action until it has joined (stop at once,
        # even inside a collective join). As PID 1, a loading or joining worker ignored SIGTERM and
        # every roll or group restart that caught one waited out the whole grace period
        # (tests/operator/test_pods_run.py).
        "shareProcessNamespace": True,
        # lopa never calls the API server: no token in the pods.
        "automountServiceAccountToken": False,
        "securityContext": security.pod_context(spec),
        **gang.pod_fields(spec, name, index),
    }
    # hf:// sources: fetched into the model cache before the container starts (model_source.py).
    fetch = model_source.init_containers(spec, specs.image(spec), _merge_env(security.env(), spec.get("env")))
    if fetch:
        pod["initContainers"] = fetch
    if spec.get("serviceAccountName"):
        pod["serviceAccountName"] = spec["serviceAccountName"]
    if spec.get("imagePullSecrets"):
        pod["imagePullSecrets"] = copy.deepcopy(spec["imagePullSecrets"])
    if spec.get("nodeSelector"):
        pod["nodeSelector"] = dict(spec["nodeSelector"])
    all_tolerations = copy.deepcopy(spec.get("tolerations") or []) + tolerations
    if all_tolerations:
        pod["tolerations"] = all_tolerations
    return pod


# Prometheus's annotation convention (the community chart's kubernetes-pods job); Prometheus
# Operator users enable the chart's PodMonitor instead (metrics.podMonitor).
_SCRAPE = {"prometheus.io/scrape": "true", "prometheus.io/port": str(names.METRICS_PORT),
           "prometheus.io/path": "/metrics"}


def _template(
    name: str, role: str, index: int, config_hash: str, secret_hash: str, pod: dict[str, Any],
    spec: dict[str, Any],
) -> dict[str, Any]:
    annotations = {names.CONFIG_HASH_ANNOTATION: config_hash, **_SCRAPE}
    if secret_hash:  # (group_hash renders the templates without it: one hash per spec)
        annotations[names.SECRET_HASH_ANNOTATION] = secret_hash
    labels = {**names.labels(name, role, index), **names.serving_labels(name, role)}
    return {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod}


def worker_template(
    name: str, spec: dict[str, Any], config_hash: str, index: int, secret_hash: str = ""
) -> dict[str, Any]:
    wiring = accelerators.wiring(spec)
    model_volumes, model_mounts = model_source.volumes(spec)
    group_volumes, group_mounts = _group_volumes(name, index)
    env = _merge_env(
        [
            # Rank = StatefulSet pod index; kubelet expands $(LOPA_RANK) in the command below.
            _field_env("LOPA_RANK", f"metadata.labels['{names.POD_INDEX_LABEL}']"),
            {"name": "LOPA_WORLD_SIZE", "value": str(spec["branchParallelism"])},
            _field_env("LOPA_POD_NAME", "metadata.name"),
            _field_env("LOPA_NAMESPACE", "metadata.namespace"),
            *security.env(),
            *wiring.env,
        ],
        spec.get("env"),
    )
    container = {
        "name": names.ROLE_WORKER,
        "image": specs.image(spec),
        "imagePullPolicy": spec["imagePullPolicy"],
        "command": [
            "lopa",
            "worker",
            "--config",
            f"{names.CONFIG_DIR}/{names.CONFIG_FILE}",
            "--rank",
            "$(LOPA_RANK)",
        ],
        "env": env,
        "ports": [
            {"name": "grpc", "containerPort": names.WORKER_PORT, "protocol": "TCP"},
            {"name": "rendezvous", "containerPort": names.RENDEZVOUS_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": names.METRICS_PORT, "protocol": "TCP"},
        ],
        "resources": _resources(spec.get("resources"), wiring.limits),
        "volumeMounts": [*group_mounts, *model_mounts, *wiring.mounts],
        # The worker API listens once the model is loaded and, on an accelerator, its branch budget
        # measured (seconds; workers serve no grpc.health); that the group joined is what the
        # master's health reports (CollectiveReady).
        "readinessProbe": {"tcpSocket": {"port": "grpc"}, "periodSeconds": 5, "failureThreshold": 3},
        "terminationMessagePolicy": TERMINATION_MESSAGE,
        "securityContext": security.container_context(spec),
    }
    pod = _common_pod_spec(spec, wiring.tolerations, name, index)
    pod["containers"] = [container]
    pod["volumes"] = [*group_volumes, *model_volumes, *wiring.volumes]
    _place(pod, spec, name, index, names.ROLE_WORKER)
    return _template(name, names.ROLE_WORKER, index, config_hash, secret_hash, pod, spec)


def _master_probe(tls: dict[str, Any] | None, http: bool) -> dict[str, Any]:
    # grpc.health.v1 reports SERVING only once every worker joined the group (and NOT_SERVING again
    # when one is lost). The kubelet's gRPC probe speaks no TLS: with TLS the master also serves the
    # same health status alone, in plaintext, on master.health_port (rendered by config.render).
    # With the HTTP API on, its /health (the same status) is probed instead, over HTTPS under TLS,
    # unless client certificates are required (the kubelet has none).
    timing = {"periodSeconds": 5, "failureThreshold": 3}
    if http and not (tls and tls.get("requireClientCert")):
        scheme = "HTTPS" if tls else "HTTP"
        return {"httpGet": {"path": "/health", "port": "http", "scheme": scheme}, **timing}
    port = names.HEALTH_PORT if tls else names.CLIENT_PORT
    return {"grpc": {"port": port}, **timing}


def master_template(
    name: str, spec: dict[str, Any], config_hash: str, index: int, secret_hash: str = ""
) -> dict[str, Any]:
    model_volumes, model_mounts = model_source.volumes(spec)  # the master needs the tokenizer files
    group_volumes, group_mounts = _group_volumes(name, index)
    mounts = [*group_mounts, *model_mounts]
    volumes = [*group_volumes, *model_volumes]
    ports = [
        {"name": "grpc", "containerPort": names.CLIENT_PORT, "protocol": "TCP"},
        {"name": "metrics", "containerPort": names.METRICS_PORT, "protocol": "TCP"},
    ]
    tls = spec.get("tls")
    http = bool((spec.get("service") or {}).get("httpPort"))
    if http:
        ports.append({"name": "http", "containerPort": names.HTTP_PORT, "protocol": "TCP"})
    if tls:
        ports.append({"name": "health", "containerPort": names.HEALTH_PORT, "protocol": "TCP"})
        mounts.append({"name": TLS_VOLUME, "mountPath": names.TLS_DIR, "readOnly": True})
        volumes.append({"name": TLS_VOLUME, "secret": _secret_source(tls["secretName"])})
    container = {
        "name": names.ROLE_MASTER,
        "image": specs.image(spec),
        "imagePullPolicy": spec["imagePullPolicy"],
        "command": ["lopa", "master", "--config", f"{names.CONFIG_DIR}/{names.CONFIG_FILE}"],
        "env": _merge_env(
            [
                _field_env("LOPA_POD_NAME", "metadata.name"),
                _field_env("LOPA_NAMESPACE", "metadata.namespace"),
                *security.env(),
            ],
            spec.get("env"),
        ),
        "ports": ports,
        "resources": copy.deepcopy((spec.get("master") or {}).get("resources") or {}),
        "volumeMounts": mounts,
        "readinessProbe": _master_probe(tls, http),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_SLEEP_S}}},
        "terminationMessagePolicy": TERMINATION_MESSAGE,
        "securityContext": security.container_context(spec),
    }
    # The workers' tolerations (the automatic device one included) but not their device requests:
    # with spec.nodeSelector picking tainted accelerator nodes the master must tolerate the taint
    # too, and sharing the workers' nodes keeps the per-step round trips short.
    pod = _common_pod_spec(spec, accelerators.wiring(spec).tolerations, name, index)
    pod["containers"] = [container]
    pod["volumes"] = volumes
    _place(pod, spec, name, index, names.ROLE_MASTER)
    return _template(name, names.ROLE_MASTER, index, config_hash, secret_hash, pod, spec)


def _place(pod: dict[str, Any], spec: dict[str, Any], name: str, index: int, role: str) -> None:
    rules = placement.affinity(spec, name, index, role)
    if rules:
        pod["affinity"] = rules
