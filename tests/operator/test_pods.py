"""Pure tests of the pod templates: env merging, master placement, master probe, metrics Service."""

from __future__ import annotations

import yaml

from lopa.serving.shared.config import parse_config, validate
from lopa_operator import names, render
from lopa_operator import spec as specs

NVIDIA_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def by_kind(objs: list[dict]) -> dict[str, dict]:
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objs}


def pod_specs(name: str, spec: dict) -> tuple[dict, dict]:
    objs = by_kind(render.children(name, "ns", spec))
    worker = objs[f"StatefulSet/{names.worker_set(name, 0)}"]["spec"]["template"]["spec"]
    master = objs[f"Deployment/{names.master(name, 0)}"]["spec"]["template"]["spec"]
    return worker, master


def env_names(container: dict) -> list[str]:
    return [e["name"] for e in container["env"]]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container["env"]}


def test_user_env_overrides_operator_defaults_in_place() -> None:
    base = {"accelerator": {"type": "nvidia"}}
    default_worker, _ = pod_specs("d", base)
    spec = {
        **base,
        "env": [
            {"name": "NCCL_DEBUG", "value": "INFO"},
            {"name": "HF_HOME", "value": "/cache"},  # an operator default too (the writable /tmp)
            {"name": "MODEL_CACHE", "value": "/cache"},
            {"name": "MODEL_CACHE", "value": "/cache2"},  # duplicates would fail server-side apply too
        ],
    }
    worker, master = pod_specs("d", spec)
    container = worker["containers"][0]
    names_ = env_names(container)
    assert len(names_) == len(set(names_))  # server-side apply refuses duplicate keys
    # Order stable: the operator's entries where they were, the user's new ones after them.
    assert names_ == [*env_names(default_worker["containers"][0]), "MODEL_CACHE"]
    assert env_of(container)["NCCL_DEBUG"] == {"name": "NCCL_DEBUG", "value": "INFO"}
    assert env_of(container)["HF_HOME"]["value"] == "/cache"
    assert env_of(container)["MODEL_CACHE"]["value"] == "/cache2"
    assert env_of(master["containers"][0])["MODEL_CACHE"]["value"] == "/cache2"
    assert len(env_names(master["containers"][0])) == len(set(env_names(master["containers"][0])))


def test_operator_owned_lopa_variables_ignore_user_entries() -> None:
    spec = {
        "branchParallelism": 2,
        "env": [
            {"name": "LOPA_RANK", "value": "7"},
            {"name": "LOPA_WORLD_SIZE", "value": "9"},
            {"name": "LOPA_POD_NAME", "value": "x"},
            {"name": "LOPA_EXTRA", "value": "kept"},  # a LOPA_ name the operator does not set
        ],
    }
    worker, master = pod_specs("d", spec)
    env = env_of(worker["containers"][0])
    rank = env["LOPA_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert rank == f"metadata.labels['{names.POD_INDEX_LABEL}']"
    assert env["LOPA_WORLD_SIZE"] == {"name": "LOPA_WORLD_SIZE", "value": "2"}
    assert env["LOPA_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["LOPA_EXTRA"]["value"] == "kept"
    assert len(env_names(worker["containers"][0])) == len(env)
    menv = env_of(master["containers"][0])
    assert menv["LOPA_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert menv["LOPA_EXTRA"]["value"] == "kept"


def test_master_tolerates_the_device_taint_without_requesting_devices() -> None:
    spec = {
        "accelerator": {"type": "nvidia"},
        "nodeSelector": {"nvidia.com/gpu.present": "true"},
        "tolerations": [{"key": "pool", "operator": "Exists"}],
    }
    worker, master = pod_specs("g", spec)
    assert NVIDIA_TAINT in worker["tolerations"]
    assert master["tolerations"] == worker["tolerations"]
    assert master["nodeSelector"] == worker["nodeSelector"]
    resources = master["containers"][0]["resources"]
    assert not any("/" in k for part in resources.values() for k in part)  # no nvidia.com/gpu
    assert "dshm" not in [v["name"] for v in master["volumes"]]


def test_master_tolerates_ascend_taint_and_cpu_has_none() -> None:
    _, master = pod_specs("a", {"accelerator": {"type": "ascend"}})
    resource = specs.RESOURCE_NAMES["ascend"]
    assert {"key": resource, "operator": "Exists", "effect": "NoSchedule"} in master["tolerations"]
    _, master = pod_specs("c", {"accelerator": {"type": "cpu"}})
    assert "tolerations" not in master


def test_tls_master_probe_checks_the_plaintext_health_port() -> None:
    spec = {"tls": {"secretName": "lopa-tls"}}
    objs = by_kind(render.children("t", "ns", spec))
    master = objs["Deployment/t-0-master"]["spec"]["template"]["spec"]["containers"][0]
    assert master["readinessProbe"] == {"grpc": {"port": names.HEALTH_PORT}, "periodSeconds": 5,
                                        "failureThreshold": 3}
    assert {"name": "health", "containerPort": names.HEALTH_PORT, "protocol": "TCP"} in master["ports"]
    doc = yaml.safe_load(objs["ConfigMap/t-0-config"]["data"][names.CONFIG_FILE])
    assert doc["master"]["health_port"] == names.HEALTH_PORT
    config = parse_config(doc)
    validate(config)
    assert config.master.health_port == names.HEALTH_PORT
    assert names.HEALTH_PORT not in (names.CLIENT_PORT, names.METRICS_PORT, names.WORKER_PORT)


def test_plaintext_master_has_no_health_port() -> None:
    objs = by_kind(render.children("p", "ns", {}))
    master = objs["Deployment/p-0-master"]["spec"]["template"]["spec"]["containers"][0]
    assert master["readinessProbe"]["grpc"] == {"port": names.CLIENT_PORT}
    assert "health" not in [p["name"] for p in master["ports"]]
    doc = yaml.safe_load(objs["ConfigMap/p-0-config"]["data"][names.CONFIG_FILE])
    assert "health_port" not in doc["master"]


def test_metrics_are_not_on_the_client_service() -> None:
    spec = {"service": {"type": "LoadBalancer", "port": 443}}
    objs = by_kind(render.children("m", "ns", spec))
    client = objs["Service/m"]["spec"]
    assert client["type"] == "LoadBalancer"
    assert [p["name"] for p in client["ports"]] == ["grpc"]
    metrics = objs[f"Service/{names.master_metrics_service('m')}"]
    assert metrics["spec"]["type"] == "ClusterIP"
    assert metrics["spec"]["selector"] == names.labels("m", names.ROLE_MASTER)
    port = {"name": "metrics", "port": names.METRICS_PORT, "targetPort": "metrics"}
    assert metrics["spec"]["ports"] == [port]
    master = objs["Deployment/m-0-master"]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "metrics", "containerPort": names.METRICS_PORT, "protocol": "TCP"} in master["ports"]


def test_the_http_api_renders_its_port_service_probe_and_config() -> None:
    """spec.service.httpPort turns on the master's OpenAI-compatible API."""
    objs = by_kind(render.children("h", "ns", {"service": {"httpPort": 8080}}))
    master = objs["Deployment/h-0-master"]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "http", "containerPort": names.HTTP_PORT, "protocol": "TCP"} in master["ports"]
    assert master["readinessProbe"] == {"httpGet": {"path": "/health", "port": "http", "scheme": "HTTP"},
                                        "periodSeconds": 5, "failureThreshold": 3}
    ports = objs["Service/h"]["spec"]["ports"] if "Service/h" in objs else next(
        o["spec"]["ports"] for k, o in objs.items() if k.startswith("Service/") and any(
            p["name"] == "http" for p in o["spec"]["ports"]))
    assert {"name": "http", "port": 8080, "targetPort": "http", "appProtocol": "http"} in ports
    doc = yaml.safe_load(objs["ConfigMap/h-0-config"]["data"][names.CONFIG_FILE])
    config = parse_config(doc)  # the rendered config loads in the runtime
    validate(config)
    assert (config.master.http_port, config.master.model_name) == (names.HTTP_PORT, "h")
    assert names.HTTP_PORT not in (names.CLIENT_PORT, names.METRICS_PORT, names.HEALTH_PORT)
    # Under TLS the probe speaks HTTPS; with client certificates required the kubelet cannot, so
    # the plaintext gRPC health port is probed as before.
    tls = {"service": {"httpPort": 8080}, "tls": {"secretName": "s"}}
    _, master_spec = pod_specs("t", tls)
    assert master_spec["containers"][0]["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    _, master_spec = pod_specs("m", {**tls, "tls": {"secretName": "s", "requireClientCert": True}})
    assert master_spec["containers"][0]["readinessProbe"]["grpc"] == {"port": names.HEALTH_PORT}
    plain = by_kind(render.children("p", "ns", {}))
    assert not any(p["name"] == "http" for o in plain.values() if o["kind"] == "Service"
                   for p in o["spec"]["ports"])


def test_pods_get_a_grace_period_that_covers_the_drain() -> None:
    """SIGTERM drains requests for up to limits.requestTimeoutSeconds: the grace period covers it."""
    worker, master = pod_specs("g", {"limits": {"requestTimeoutSeconds": 120}})
    # the master's preStop sleep (out of the Services first), the longest request, the margin;
    # the workers get as long: they serve the steps of their master's drain
    assert master["containers"][0]["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    assert worker["terminationGracePeriodSeconds"] == master["terminationGracePeriodSeconds"] == 140
    worker, _ = pod_specs("d", {})
    assert worker["terminationGracePeriodSeconds"] == specs.DEFAULTS["limits"]["requestTimeoutSeconds"] + 20
    assert "lifecycle" not in worker["containers"][0]


def test_lopa_is_not_pid_1_so_sigterm_stops_a_worker_at_once() -> None:
    # Until it joins, a worker leaves SIGTERM at its default action; as a container's PID 1 it would
    # ignore it and hold a roll for the whole grace period.
    for spec in ({}, {"accelerator": {"type": "nvidia"}}, {"accelerator": {"type": "ascend"}}):
        worker, master = pod_specs("s", spec)
        assert worker["shareProcessNamespace"] is True
        assert master["shareProcessNamespace"] is True


def test_a_groups_workers_prefer_one_node_by_default() -> None:
    worker, master = pod_specs("d", {"accelerator": {"type": "nvidia"}, "replicas": 2})
    group_workers = {"labelSelector": {"matchLabels": names.labels("d", names.ROLE_WORKER, 0)},
                     "topologyKey": "kubernetes.io/hostname"}
    for pod in (worker, master):
        assert pod["affinity"] == {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "podAffinityTerm": group_workers}]}}
    assert names.GROUP_LABEL in group_workers["labelSelector"]["matchLabels"]  # its own group's only


def test_required_binds_the_workers_not_the_master_and_keeps_the_users_terms() -> None:
    theirs = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                  {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]}]}},
              "podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                  {"weight": 5, "podAffinityTerm": {"labelSelector": {}, "topologyKey": "zone"}}]}}
    spec = {"accelerator": {"type": "nvidia"}, "placement": {"sameNode": "Required"}, "affinity": theirs}
    worker, master = pod_specs("d", spec)
    assert worker["affinity"]["nodeAffinity"] == theirs["nodeAffinity"]
    (required,) = worker["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert required["topologyKey"] == "kubernetes.io/hostname"
    assert worker["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == (
        theirs["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"])
    # the master may not be required beside the workers (they would follow it to a CPU node)
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in master["affinity"]["podAffinity"]
    assert len(master["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]) == 2


def test_no_placement_adds_nothing() -> None:
    worker, master = pod_specs("d", {"placement": {"sameNode": "None"}})
    assert "affinity" not in worker and "affinity" not in master


def test_nulls_in_the_users_affinity_are_no_error() -> None:
    # spec.affinity keeps unknown fields, so nulls reach the operator
    worker, _ = pod_specs("d", {"affinity": {"podAffinity": None, "nodeAffinity": None}})
    assert len(worker["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]) == 1
    worker, _ = pod_specs("d", {"affinity": {"podAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": None}}, "placement": {"sameNode": "Required"}})
    assert len(worker["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]) == 1


def test_only_the_groups_own_required_term_counts_as_same_node() -> None:
    from lopa_operator import placement

    required, _ = pod_specs("d", {"placement": {"sameNode": "Required"}})
    theirs = {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {"app": "cache"}}, "topologyKey": "kubernetes.io/hostname"}]}}
    users, _ = pod_specs("d", {"placement": {"sameNode": "None"}, "affinity": theirs})
    assert placement.requires_same_node({"spec": required})
    assert not placement.requires_same_node({"spec": users})


def test_a_topology_key_groups_the_workers_in_one_domain_beside_same_node() -> None:
    from lopa_operator import placement

    zone = "topology.kubernetes.io/zone"
    worker, master = pod_specs("d", {"placement": {"topology": {"key": zone}}})
    (required,) = worker["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert required == {"labelSelector": {"matchLabels": names.labels("d", names.ROLE_WORKER, 0)},
                        "topologyKey": zone}
    # sameNode keeps its default (Preferred) beside the zone; the master prefers both
    preferred = worker["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert [p["podAffinityTerm"]["topologyKey"] for p in preferred] == ["kubernetes.io/hostname"]
    master_terms = master["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert [p["podAffinityTerm"]["topologyKey"] for p in master_terms] == ["kubernetes.io/hostname", zone]
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in master["affinity"]["podAffinity"]
    assert placement.required_domain({"spec": worker}) == zone
    assert not placement.requires_same_node({"spec": worker})

    loose = {"sameNode": "None", "topology": {"key": "rack", "mode": "Preferred"}}
    rack, _ = pod_specs("d", {"placement": loose})
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in rack["affinity"]["podAffinity"]
    (only,) = rack["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert only["podAffinityTerm"]["topologyKey"] == "rack"
    same, _ = pod_specs("d", {"placement": {"sameNode": "Required",
                                            "topology": {"key": "kubernetes.io/hostname"}}})
    assert len(same["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]) == 1


def test_pods_carry_the_labels_llm_d_and_the_gateway_select_on() -> None:
    objs = by_kind(render.children("chat", "ns", {}))
    master = objs["Deployment/chat-0-master"]["spec"]["template"]["metadata"]["labels"]
    worker = objs["StatefulSet/chat-0-worker"]["spec"]["template"]["metadata"]["labels"]
    assert master["llm-d.ai/inferenceServing"] == "true" and master["llm-d.ai/role"] == "both"
    assert master["llm-d.ai/model"] == worker["llm-d.ai/model"] == "chat"  # the name the OpenAI API serves
    # workers serve no client: nothing that selects model servers picks them
    assert "llm-d.ai/inferenceServing" not in worker and "llm-d.ai/role" not in worker
