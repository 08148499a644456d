"""The NetworkPolicies: who may reach which port of which pod, as a table of (from pod, to pod, port,
allowed), judged by network_reach against the policies' selectors and the pods' labels and ports.

The unit tests judge the rendered policies and pods; the cluster test judges the policies and pods
that the API server holds once the operator made them (accepted as rendered, nothing dropped).
"""

from __future__ import annotations

from typing import Any

import pytest
from lopa_op_helpers import is_available, pods, wait_status
from network_reach import Cluster, matches

from kube.cluster import KubeCluster
from lopa_operator import names, network, render
from lopa_operator import spec as specs

NS, MONITORING = "serving", "monitoring"
COLLECTIVE_PORT = 41234  # a gloo data connection: a port the worker opens beyond the rendezvous
PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}


def rendered_pods(name: str, spec: dict[str, Any], namespace: str = NS) -> dict[str, dict[str, Any]]:
    """'<name>-<i>-master' and '<name>-<i>-worker-<rank>' -> a Pod as its controller makes it."""
    out = {}
    full = specs.with_defaults(spec)
    for child in render.children(name, namespace, spec):
        if child["kind"] not in ("StatefulSet", "Deployment"):
            continue
        template = child["spec"]["template"]
        count = full["branchParallelism"] if child["kind"] == "StatefulSet" else 1
        for rank in range(count):
            pod_name = f"{child['metadata']['name']}-{rank}" if child["kind"] == "StatefulSet" else \
                child["metadata"]["name"]
            labels = dict(template["metadata"]["labels"])
            if child["kind"] == "StatefulSet":
                labels[names.POD_INDEX_LABEL] = str(rank)
            out[pod_name] = {"metadata": {"name": pod_name, "namespace": namespace, "labels": labels},
                             "spec": template["spec"]}
    return out


def plain_pod(name: str, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": namespace, "labels": labels},
            "spec": {"containers": [{"name": "c"}]}}


# (from, to, port, protocol, allowed). a and b are two LoPADeployments of the namespace; a runs two
# groups of two workers. "client" is any pod of the namespace, "elsewhere" any pod of another,
# "prometheus" a Prometheus pod and "stranger" another pod of the monitoring namespace.
DEFAULT_TABLE = [
    # A group's workers reach each other on every port: worker API, rendezvous, collective.
    ("a-0-worker-0", "a-0-worker-1", names.WORKER_PORT, "TCP", True),
    ("a-0-worker-1", "a-0-worker-0", names.RENDEZVOUS_PORT, "TCP", True),
    ("a-0-worker-0", "a-0-worker-1", COLLECTIVE_PORT, "TCP", True),
    # Its master reaches their worker API, nothing else of theirs.
    ("a-0-master", "a-0-worker-0", names.WORKER_PORT, "TCP", True),
    ("a-0-master", "a-0-worker-0", names.RENDEZVOUS_PORT, "TCP", False),
    ("a-0-master", "a-0-worker-1", COLLECTIVE_PORT, "TCP", False),
    ("a-0-master", "a-0-worker-0", names.METRICS_PORT, "TCP", False),
    # Another group of the same deployment reaches none of a group's ports.
    ("a-1-worker-0", "a-0-worker-0", names.WORKER_PORT, "TCP", False),
    ("a-1-worker-0", "a-0-worker-0", names.RENDEZVOUS_PORT, "TCP", False),
    ("a-1-worker-1", "a-0-worker-1", COLLECTIVE_PORT, "TCP", False),
    ("a-1-master", "a-0-worker-0", names.WORKER_PORT, "TCP", False),
    ("a-0-master", "a-1-worker-0", names.WORKER_PORT, "TCP", False),
    # Nor does another deployment, nor any other pod.
    ("b-0-worker-0", "a-0-worker-0", names.RENDEZVOUS_PORT, "TCP", False),
    ("b-0-master", "a-0-worker-0", names.WORKER_PORT, "TCP", False),
    ("client", "a-0-worker-0", names.WORKER_PORT, "TCP", False),
    ("client", "a-0-worker-0", names.RENDEZVOUS_PORT, "TCP", False),
    ("elsewhere", "a-0-worker-1", COLLECTIVE_PORT, "TCP", False),
    # The client port is the service: open to any pod, here or elsewhere.
    ("client", "a-0-master", names.CLIENT_PORT, "TCP", True),
    ("elsewhere", "a-1-master", names.CLIENT_PORT, "TCP", True),
    ("b-0-worker-0", "a-0-master", names.CLIENT_PORT, "TCP", False),  # b's workers send to b's group only
    # The metrics port: Prometheus only.
    ("prometheus", "a-0-worker-0", names.METRICS_PORT, "TCP", True),
    ("prometheus", "a-1-master", names.METRICS_PORT, "TCP", True),
    ("prometheus", "a-0-worker-0", names.WORKER_PORT, "TCP", False),
    ("stranger", "a-0-worker-0", names.METRICS_PORT, "TCP", False),
    ("client", "a-0-master", names.METRICS_PORT, "TCP", False),
    ("elsewhere", "a-0-master", names.METRICS_PORT, "TCP", False),
    # Egress: a group's pods open connections to their group's workers and to DNS, nowhere else.
    ("a-0-worker-0", "elsewhere", 53, "UDP", True),
    ("a-0-master", "elsewhere", 53, "TCP", True),
    ("a-0-worker-0", "a-0-master", names.CLIENT_PORT, "TCP", False),
    ("a-0-worker-0", "client", 8080, "TCP", False),
    ("a-0-master", "client", 443, "TCP", False),
    ("a-0-master", "b-0-master", names.CLIENT_PORT, "TCP", False),
]


def world(spec: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], Cluster]:
    pod_map = {
        **rendered_pods("a", {**spec, "replicas": 2, "branchParallelism": 2}),
        **rendered_pods("b", {**spec, "branchParallelism": 2}),
        "client": plain_pod("client", NS, {"app": "client"}),
        "elsewhere": plain_pod("elsewhere", "other", {"app": "client"}),
        "prometheus": plain_pod("prometheus", MONITORING, PROMETHEUS),
        "stranger": plain_pod("stranger", MONITORING, {"app": "stranger"}),
    }
    policies = [c for name, replicas in (("a", 2), ("b", 1))
                for c in render.children(name, NS, {**spec, "replicas": replicas, "branchParallelism": 2})
                if c["kind"] == "NetworkPolicy"]
    return pod_map, Cluster({}, policies)


def judge(table: list[tuple[str, str, int, str, bool]], pod_map: dict[str, Any], cluster: Cluster) -> None:
    wrong = [(src, dst, port, proto, want) for src, dst, port, proto, want in table
             if cluster.allowed(pod_map[src], pod_map[dst], port, proto) != want]
    assert not wrong, "\n".join(f"{s} -> {d}:{p}/{pr} should be {'allowed' if w else 'refused'}"
                                for s, d, p, pr, w in wrong)


def test_default_policies_confine_each_group_and_open_the_client_port() -> None:
    pod_map, cluster = world({})
    judge(DEFAULT_TABLE, pod_map, cluster)


def test_client_and_metrics_peers_and_extra_egress_are_the_users() -> None:
    gateway = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "other"}}}
    scraper = {"podSelector": {"matchLabels": {"app": "client"}}}  # a scraper in the namespace
    store = {"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": MONITORING}}}],
             "ports": [{"protocol": "TCP", "port": 443}]}
    pod_map, cluster = world({
        "tls": {"secretName": "t"}, "service": {"httpPort": 443},
        "networkPolicy": {"clientFrom": [gateway], "metricsFrom": [scraper], "egress": [store]},
    })
    judge([
        ("elsewhere", "a-0-master", names.CLIENT_PORT, "TCP", True),
        ("elsewhere", "a-0-master", names.HTTP_PORT, "TCP", True),  # container ports, not Service ports
        ("elsewhere", "a-0-master", names.HEALTH_PORT, "TCP", True),
        ("client", "a-0-master", names.CLIENT_PORT, "TCP", False),
        ("client", "a-0-worker-0", names.METRICS_PORT, "TCP", True),
        ("prometheus", "a-0-worker-0", names.METRICS_PORT, "TCP", False),
        ("a-0-worker-0", "stranger", 443, "TCP", True),
        ("a-0-master", "prometheus", 443, "TCP", True),
        ("a-0-master", "prometheus", 80, "TCP", False),
        ("a-1-worker-0", "a-0-worker-0", names.RENDEZVOUS_PORT, "TCP", False),
    ], pod_map, cluster)


@pytest.mark.parametrize(
    ("hub", "port", "other"), [(None, 443, 80), ("http://mirror.internal:8080", 8080, 443)]
)
def test_a_deployment_that_fetches_from_the_hub_may_reach_the_hubs_port(
    hub: str | None, port: int, other: int
) -> None:
    model: dict[str, Any] = {"uri": "hf://org/model@main"}
    if hub:
        model["huggingFace"] = {"endpoint": hub}
    pod_map, cluster = world({"model": model})
    judge([
        ("a-0-worker-0", "elsewhere", port, "TCP", True),  # the init containers' download
        ("a-0-master", "stranger", port, "TCP", True),
        ("a-0-worker-0", "elsewhere", other, "TCP", False),
        ("a-1-worker-0", "a-0-worker-0", names.RENDEZVOUS_PORT, "TCP", False),  # ingress unchanged
    ], pod_map, cluster)


def test_an_empty_scraper_list_admits_anyone_and_the_operator_default_is_configurable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pod_map, cluster = world({"networkPolicy": {"metricsFrom": []}})
    judge([("stranger", "a-0-worker-0", names.METRICS_PORT, "TCP", True),
           ("stranger", "a-0-worker-0", names.WORKER_PORT, "TCP", False)], pod_map, cluster)
    agent = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": MONITORING}},
              "podSelector": {"matchLabels": {"app": "stranger"}}}]
    monkeypatch.setenv(network.METRICS_FROM_ENV, '[{"namespaceSelector": {"matchLabels": '
                       '{"kubernetes.io/metadata.name": "monitoring"}}, "podSelector": '
                       '{"matchLabels": {"app": "stranger"}}}]')
    assert network.metrics_from(specs.with_defaults({})) == agent
    pod_map, cluster = world({})
    judge([("stranger", "a-0-worker-0", names.METRICS_PORT, "TCP", True),
           ("prometheus", "a-0-worker-0", names.METRICS_PORT, "TCP", False)], pod_map, cluster)


@pytest.mark.parametrize("value", ["{not json", '{"podSelector": {}}', "[1]"])
def test_a_bad_default_scraper_list_names_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(network.METRICS_FROM_ENV, value)
    with pytest.raises(ValueError, match=network.METRICS_FROM_ENV):
        network.default_metrics_from()


def test_two_policies_per_group_named_as_what_they_select_unless_disabled() -> None:
    objs = render.shared_children("d", "ns", {"replicas": 2})
    fences = {o["metadata"]["name"]: o for o in objs if o["kind"] == "NetworkPolicy"}
    assert sorted(fences) == ["d-0-master", "d-0-worker", "d-1-master", "d-1-worker"]
    for index in range(2):
        for role in network.ROLES:
            selector = fences[names.network_policy("d", index, role)]["spec"]["podSelector"]
            assert selector == {"matchLabels": names.labels("d", role, index)}
    off = render.shared_children("d", "ns", {"networkPolicy": {"enabled": False}})
    assert "NetworkPolicy" not in [c["kind"] for c in off]


def test_the_judge_follows_the_networkpolicy_semantics() -> None:
    """network_reach itself, on textbook policies: an unselected pod is open, a selected one admits
    only what a rule matches, a namespaceSelector beside a podSelector is an AND and two peers an OR,
    a named port is the destination's."""
    pod_map = {
        "web": {"metadata": {"name": "web", "namespace": "x", "labels": {"app": "web"}},
                "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8080}]}]}},
        "db": plain_pod("db", "x", {"app": "db"}),
        "api": plain_pod("api", "y", {"app": "api"}),
        "api-x": plain_pod("api-x", "x", {"app": "api"}),
    }
    assert Cluster({}, []).allowed(pod_map["api"], pod_map["db"], 5432)
    both = {"namespaceSelector": {"matchLabels": {"team": "y"}},
            "podSelector": {"matchLabels": {"app": "api"}}}
    policy = {"metadata": {"namespace": "x"}, "spec": {
        "podSelector": {"matchLabels": {"app": "web"}},
        "ingress": [{"from": [both], "ports": [{"port": "http"}]}]}}
    cluster = Cluster({"y": {"team": "y"}}, [policy])
    assert cluster.allowed(pod_map["api"], pod_map["web"], 8080)
    assert not cluster.allowed(pod_map["api"], pod_map["web"], 9090)
    assert not cluster.allowed(pod_map["api-x"], pod_map["web"], 8080)  # x has no label team=y
    assert cluster.allowed(pod_map["api-x"], pod_map["db"], 5432)  # db: selected by no policy
    either = {"metadata": {"namespace": "x"}, "spec": {
        "podSelector": {"matchLabels": {"app": "web"}},
        "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"team": "y"}}},
                              {"podSelector": {"matchLabels": {"app": "api"}}}]}]}}
    assert Cluster({"y": {"team": "y"}}, [either]).allowed(pod_map["api-x"], pod_map["web"], 1)
    deny_out = {"metadata": {"namespace": "x"}, "spec": {"podSelector": {}, "policyTypes": ["Egress"]}}
    assert not Cluster({}, [deny_out]).allowed(pod_map["db"], pod_map["api"], 80)
    assert matches({"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["db"]}]}, {})


def test_the_api_server_holds_the_policies_as_rendered_and_the_table_holds_on_them(
    kube: KubeCluster, ns: str
) -> None:
    """On the real API server: the operator's policies for two deployments (one of two groups) are
    stored as rendered, and the default table holds for the pods the controllers made (kwok runs
    them) and for plain pods here and in another namespace."""
    other = f"{ns}-other"  # stands for both "other" and "monitoring": the table tells them apart by
    kube.kubectl("create", "namespace", other)  # pod labels, as the default policies do
    try:
        _judge_on_the_server(kube, ns, other)
    finally:
        kube.kubectl("delete", "namespace", other, "--wait=false", check=False)


def _judge_on_the_server(kube: KubeCluster, ns: str, other: str) -> None:
    for name, replicas in (("a", 2), ("b", 1)):
        cr = {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": name},
              "spec": {"replicas": replicas, "branchParallelism": 2}}
        kube.apply(cr, namespace=ns)
    for name in ("a", "b"):
        wait_status(kube, ns, name, is_available, timeout=90, description=f"{name} Available")
    plain = {"client": (ns, {"app": "client"}), "elsewhere": (other, {"app": "client"}),
             "prometheus": (other, PROMETHEUS), "stranger": (other, {"app": "stranger"})}
    for pod_name, (where, labels) in plain.items():
        kube.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod_name, "labels": labels},
                    "spec": {"containers": [{"name": "c", "image": "busybox"}]}}, namespace=where)
    stored = kube.get_json("networkpolicies", "-n", ns)["items"]
    rendered = [c for name, replicas in (("a", 2), ("b", 1))
                for c in render.children(name, ns, {"replicas": replicas, "branchParallelism": 2})
                if c["kind"] == "NetworkPolicy"]
    by_name = {p["metadata"]["name"]: p for p in stored}
    assert sorted(by_name) == sorted(p["metadata"]["name"] for p in rendered)
    for policy in rendered:
        assert by_name[policy["metadata"]["name"]]["spec"] == policy["spec"], policy["metadata"]["name"]
    pod_map: dict[str, dict[str, Any]] = {}
    for name in ("a", "b"):
        for pod in pods(kube, ns, name, names.ROLE_WORKER):
            pod_map[pod["metadata"]["name"]] = pod
        for pod in pods(kube, ns, name, names.ROLE_MASTER):  # "<name>-<i>-master-<hash>-<id>"
            pod_map[names.master(name, int(pod["metadata"]["labels"][names.GROUP_LABEL]))] = pod
    for pod_name, (where, _) in plain.items():
        pod_map[pod_name] = kube.get_json("pod", pod_name, "-n", where)
    namespaces = {n: kube.get_json("namespace", n)["metadata"].get("labels") or {} for n in (ns, other)}
    assert {row[i] for row in DEFAULT_TABLE for i in (0, 1)} <= set(pod_map)
    judge(DEFAULT_TABLE, pod_map, Cluster(namespaces, stored))
