"""A spec the CRD admits but the API server rejects once rendered (against a real kube-apiserver).

spec.resources is preserve-unknown-fields, so `limits.cpu: banana` reaches the StatefulSet, whose
apply the API server refuses. The reconcile (called in-process, no operator) must leave every
child as it was (dry-run first), report the API's message in the condition Reconciled=False and
a Warning event, and not claim the new generation as observed.
"""

from __future__ import annotations

import logging
from typing import Any

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from lopa_op_helpers import condition, ensure_chart, pods

from kube.cluster import KubeCluster
from lopa_operator import group, names, reconcile
from lopa_operator.kube import Kube


def _kube(cluster: KubeCluster) -> Kube:
    cfg = k8s_client.Configuration()
    k8s_config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=cfg)
    return Kube(cfg)


def test_rejected_resources_leave_children_and_report_the_api_message(
    kube: KubeCluster, namespace: str
) -> None:
    ensure_chart(kube)
    cr: dict[str, Any] = {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": "bad", "namespace": namespace},
        "spec": {"branchParallelism": 1},
    }
    kube.apply(cr)
    try:
        _rejected_then_fixed(kube, namespace)
    finally:
        # Gone before the namespace starts terminating: an operator started by a later module would
        # otherwise find the CR there and fail to post events into the terminating namespace.
        kube.kubectl("delete", names.PLURAL, "bad", "-n", namespace, "--wait=true", check=False)


def _rejected_then_fixed(kube: KubeCluster, namespace: str) -> None:
    client = _kube(kube)
    posted: list[tuple[str, str, str]] = []

    def post(obj: dict[str, Any], kind: str, reason: str, message: str) -> None:
        posted.append((kind, reason, message))

    memo: dict[str, Any] = {}

    def run() -> dict[str, Any] | None:
        return reconcile.reconcile(client, namespace, "bad", "test", post, logging.getLogger("test"), memo)

    first = run()
    assert first is not None and first["observedGeneration"] == 1
    config = kube.get_json("configmap", "bad-0-config", "-n", namespace)

    patch = '{"spec": {"decoding": {"branches": 2}, "resources": {"limits": {"cpu": "banana"}}}}'
    kube.kubectl("patch", names.PLURAL, "bad", "-n", namespace, "--type=merge", "-p", patch)
    posted.clear()  # the first reconcile may already have reported the group Available
    run()  # raises nothing: kopf would hold the object's handlers and timer for a retry's delay

    obj = kube.get_json(names.PLURAL, "bad", "-n", namespace)
    assert obj["metadata"]["generation"] == 2
    assert obj["status"]["observedGeneration"] == 1  # generation 2 is not deployed
    cond = condition(obj, "Reconciled")
    assert cond["status"] == "False" and cond["reason"] == "ApplyFailed", cond
    # The API server names the object and the rule, not the value (answered as a 500).
    assert "StatefulSet" in cond["message"] and "quantities must match" in cond["message"], cond
    # (the deployed group is still looked after: it may report itself Available meanwhile)
    assert [(k, r) for k, r, _ in posted if k == "Warning"] == [("Warning", "ApplyFailed")]
    assert _column(kube, namespace, "bad", "RECONCILED") == "False"  # kubectl get lopa shows it
    after = kube.get_json("configmap", "bad-0-config", "-n", namespace)
    assert after["data"] == config["data"]  # the dry run kept the new config from the old pods
    assert after["metadata"]["resourceVersion"] == config["metadata"]["resourceVersion"]

    # A misspelt key in a field the CRD leaves open (affinity) is the spec's fault too, though the API
    # server answers it 500; a new edit is tried at once, not after the refused one's minute.
    kube.kubectl("patch", names.PLURAL, "bad", "-n", namespace, "--type=json", "-p",
                 '[{"op": "remove", "path": "/spec/resources"}, '
                 '{"op": "add", "path": "/spec/affinity", "value": {"nodeAfinity": {}}}]')
    run()
    cond = condition(kube.get_json(names.PLURAL, "bad", "-n", namespace), "Reconciled")
    assert cond["status"] == "False" and "nodeAfinity" in cond["message"], cond

    # The spec is fixed: everything is applied and generation 4 is observed.
    kube.kubectl("patch", names.PLURAL, "bad", "-n", namespace, "--type=json", "-p",
                 '[{"op": "remove", "path": "/spec/affinity"}]')
    st = run()
    assert st is not None and st["observedGeneration"] == 4
    assert condition(kube.get_json(names.PLURAL, "bad", "-n", namespace), "Reconciled")["status"] == "True"
    assert kube.get_json("configmap", "bad-0-config", "-n", namespace)["data"] != config["data"]
    assert _column(kube, namespace, "bad", "RECONCILED") == "True"


def _column(kube: KubeCluster, namespace: str, name: str, column: str) -> str:
    """One printer column of `kubectl get lopa NAME` (the API server's table)."""
    header, row = kube.kubectl("get", "lopa", name, "-n", namespace).stdout.splitlines()[:2]
    return dict(zip(header.split(), row.split(), strict=True))[column]


def test_a_name_taken_by_an_object_of_someone_else_is_not_taken_over(
    kube: KubeCluster, namespace: str
) -> None:
    """A Service the user made, named as the CR's client Service: before, server-side apply with force
    rewrote its selector and ports, made the CR its controller, and deleting the CR deleted it."""
    ensure_chart(kube)
    theirs = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web", "namespace": namespace},
        "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80}]},
    }
    kube.apply(theirs)
    cr: dict[str, Any] = {
        "apiVersion": names.API_VERSION, "kind": names.KIND,
        "metadata": {"name": "web", "namespace": namespace}, "spec": {"branchParallelism": 1},
    }
    kube.apply(cr)
    posted: list[tuple[str, str, str]] = []
    try:
        reconcile.reconcile(_kube(kube), namespace, "web", "test",
                            lambda obj, kind, reason, message: posted.append((kind, reason, message)),
                            logging.getLogger("test"), {})
        cond = condition(kube.get_json(names.PLURAL, "web", "-n", namespace), "Reconciled")
        assert cond["status"] == "False", cond
        assert f"Service {namespace}/web already exists and belongs to no controller" in cond["message"]
        assert [(k, r) for k, r, _ in posted] == [("Warning", "ApplyFailed")]
        service = kube.get_json("service", "web", "-n", namespace)
        assert service["spec"]["selector"] == {"app": "web"}
        assert not service["metadata"].get("ownerReferences")
        assert kube.get_json("configmap", "-n", namespace, "-l", names.selector("web"))["items"] == []
    finally:
        kube.kubectl("delete", names.PLURAL, "web", "-n", namespace, "--wait=true", check=False)
    assert kube.get_json("service", "web", "-n", namespace)["spec"]["ports"][0]["port"] == 80  # still theirs


def test_a_worker_lost_while_an_edit_is_rejected_restarts_its_group_on_the_deployed_config(
    kube: KubeCluster, namespace: str
) -> None:
    """Before, a rejected edit stopped every reconcile before the group policy: a worker lost
    meanwhile was never handled (no restart) and the status kept saying Available."""
    ensure_chart(kube)
    cr: dict[str, Any] = {
        "apiVersion": names.API_VERSION, "kind": names.KIND,
        "metadata": {"name": "held", "namespace": namespace}, "spec": {"branchParallelism": 1},
    }
    kube.apply(cr)
    client, memo, quiet = _kube(kube), {}, logging.getLogger("t")

    def once() -> dict[str, Any] | None:
        return reconcile.reconcile(client, namespace, "held", "test", lambda *a: None, quiet, memo)

    def run() -> dict[str, Any]:
        """One reconcile while the edit is rejected; the object it left."""
        once()
        return kube.get_json(names.PLURAL, "held", "-n", namespace)

    def serving(st: dict[str, Any] | None) -> dict[str, Any] | None:
        return st if st and st.get("readyReplicas") == 1 and st["groups"][0]["available"] else None

    try:
        first = kube.wait_for(lambda: serving(once()), timeout=60, interval=0.5, description="group serving")
        (worker,) = pods(kube, namespace, "held")
        kube.kubectl("patch", names.PLURAL, "held", "-n", namespace, "--type=merge",
                     "-p", '{"spec": {"resources": {"limits": {"cpu": "banana"}}}}')
        run()
        kube.kubectl("delete", "pod", worker["metadata"]["name"], "-n", namespace, "--wait=false")

        obj = run()
        st = obj["status"]
        assert st["groupRestarts"] == 1, st  # the lost worker was handled
        assert condition(obj, "Available")["status"] == "False", st["conditions"]
        assert condition(obj, "Reconciled")["reason"] == "ApplyFailed"
        # ... on the deployed config: generation 2 is still not claimed as observed
        assert st["observedGeneration"] == 1 and st["configHash"] == first["configHash"], st

        back = kube.wait_for(lambda: serving(run()["status"]), timeout=60, interval=0.5,
                             description="group back on its deployed config")
        assert back["groupRestarts"] == 1 and back["observedGeneration"] == 1
        (again,) = pods(kube, namespace, "held")
        assert again["metadata"]["uid"] != worker["metadata"]["uid"]
        assert group.config_hash(again) == first["configHash"]
    finally:
        kube.kubectl("delete", names.PLURAL, "held", "-n", namespace, "--wait=true", check=False)


def test_a_scale_up_beyond_a_resource_quota_is_reported_and_the_deployed_group_serves(
    kube: KubeCluster, namespace: str
) -> None:
    """A ResourceQuota on StatefulSets refuses a scale-up's new group (403 Forbidden, "exceeded
    quota"). Status says why: Reconciled is False with the API's message and an ApplyFailed event
    is posted; READY reads 1/2, the group that cannot be created says GroupNotCreated while group 0
    serves, and once the quota allows it the group is made."""
    ensure_chart(kube)
    quota = {
        "apiVersion": "v1", "kind": "ResourceQuota",
        "metadata": {"name": "sets", "namespace": namespace},
        "spec": {"hard": {"count/statefulsets.apps": "1"}},
    }
    kube.apply(quota)
    kube.wait_for(  # admission refuses everything it counts until the quota controller has seen it
        lambda: kube.get_json("resourcequota", "sets", "-n", namespace).get("status", {}).get("hard"),
        timeout=30, description="quota status",
    )
    cr: dict[str, Any] = {
        "apiVersion": names.API_VERSION, "kind": names.KIND,
        "metadata": {"name": "quota", "namespace": namespace}, "spec": {"branchParallelism": 1},
    }
    kube.apply(cr)
    client, memo, quiet = _kube(kube), {}, logging.getLogger("t")
    posted: list[tuple[str, str, str]] = []

    def once() -> dict[str, Any] | None:
        post = lambda obj, kind, reason, message: posted.append((kind, reason, message))  # noqa: E731
        return reconcile.reconcile(client, namespace, "quota", "test", post, quiet, memo)

    def serving(groups: int) -> bool:
        return (once() or {}).get("readyReplicas") == groups

    try:
        kube.wait_for(lambda: serving(1), timeout=60, description="group 0 serving")
        kube.kubectl("scale", names.PLURAL, "quota", "-n", namespace, "--replicas=2")
        st = once()
        assert st is not None
        obj = kube.get_json(names.PLURAL, "quota", "-n", namespace)
        cond = condition(obj, "Reconciled")
        assert cond["status"] == "False" and "exceeded quota" in cond["message"], cond
        assert st["ready"] == "1/2" and st["phase"] == "Pending" and st["replicas"] == 1, st
        assert st["groups"][1]["reason"] == "GroupNotCreated", st["groups"]
        assert st["groups"][0]["available"], st["groups"]
        assert condition(obj, "Progressing")["status"] == "False"
        assert ("Warning", "ApplyFailed") in [(k, r) for k, r, _ in posted]
        names_now = [s["metadata"]["name"] for s in kube.get_json("statefulset", "-n", namespace)["items"]]
        assert names_now == ["quota-0-worker"]

        quota["spec"]["hard"]["count/statefulsets.apps"] = "2"
        kube.apply(quota)
        kube.wait_for(
            lambda: kube.get_json("resourcequota", "sets", "-n", namespace)["status"]["hard"]
            == {"count/statefulsets.apps": "2"},
            timeout=30, description="quota raised",
        )
        memo.pop("refused")  # (as if ownership.RETRY_REFUSED_SECONDS had passed)
        st = once()
        assert st is not None and st["observedGeneration"] == 2, st
        obj = kube.get_json(names.PLURAL, "quota", "-n", namespace)
        assert condition(obj, "Reconciled")["status"] == "True"
        kube.wait_for(lambda: serving(2), timeout=60, description="both groups serving")
    finally:
        kube.kubectl("delete", names.PLURAL, "quota", "-n", namespace, "--wait=true", check=False)
