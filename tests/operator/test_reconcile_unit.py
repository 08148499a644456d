"""Reconcile against an in-memory API (no cluster): apply, group policy, status, events."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from fake_kube import FakeKube

from lopa_operator import names, reconcile
from lopa_operator.kube import KubeError, path


@pytest.fixture
def fake() -> FakeKube:
    return FakeKube.with_deployment({"branchParallelism": 2})


def run(fake: FakeKube, posted: list[tuple[str, str]]) -> dict[str, Any]:
    def post(obj: dict[str, Any], kind: str, reason: str, message: str) -> None:
        posted.append((reason, message))

    out = reconcile.reconcile(fake, "ns", "d", "test", post, logging.getLogger("test"), fake.memo)  # type: ignore[arg-type]
    assert out is not None
    return out


def count_dry_runs(fake: FakeKube) -> list[tuple[str, str]]:
    """The (kind, name) of every dry-run apply fake sees from now on, refused or not."""
    seen: list[tuple[str, str]] = []
    apply = fake.apply

    def counted(obj: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        if dry_run:
            seen.append((obj["kind"], obj["metadata"]["name"]))
        return apply(obj, dry_run)

    fake.apply = counted  # type: ignore[method-assign]
    return seen


def templates(fake: FakeKube) -> tuple[dict[str, Any], dict[str, Any]]:
    sts = fake.objects[path("StatefulSet", "ns", "d-0-worker")]["spec"]["template"]
    dep = fake.objects[path("Deployment", "ns", "d-0-master")]["spec"]["template"]
    return sts, dep


def test_reconcile_creates_owned_children_then_forms_group(fake: FakeKube) -> None:
    posted: list[tuple[str, str]] = []
    status = run(fake, posted)
    assert status["phase"] == "Progressing" and status["ready"] == "0/1" and status["workers"] == 2
    for kind, name in [
        ("ConfigMap", "d-0-config"),
        ("Service", "d-workers"),
        ("StatefulSet", "d-0-worker"),
        ("Deployment", "d-0-master"),
        ("Service", "d"),
    ]:
        (owner,) = fake.objects[path(kind, "ns", name)]["metadata"]["ownerReferences"]
        assert owner["uid"] == "cr-uid" and owner["controller"] is True
    sts, dep = templates(fake)
    for i in range(2):
        fake.add_pod(f"d-0-worker-{i}", f"w{i}", "worker", sts)
    fake.add_pod("d-0-master-abc", "m", "master", dep)
    status = run(fake, posted)
    assert status["phase"] == "Available" and status["readyWorkers"] == 2
    assert ("Available", status["conditions"][0]["message"]) in posted

    # A lost member recreates the whole group and is counted.
    del fake.objects[path("Pod", "ns", "d-0-worker-1")]
    fake.add_pod("d-0-worker-1", "w1-new", "worker", sts)
    status = run(fake, posted)
    assert sorted(fake.deleted) == ["d-0-worker-0", "d-0-worker-1"]
    assert status["groupRestarts"] == 1 and status["phase"] == "Progressing"
    assert any(reason == "GroupRestart" for reason, _ in posted)


def test_reconcile_of_deleted_object_does_nothing(fake: FakeKube) -> None:
    fake.objects[path(names.KIND, "ns", "d")]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    quiet = logging.getLogger("t")
    assert reconcile.reconcile(fake, "ns", "d", "test", lambda *a: None, quiet, fake.memo) is None  # type: ignore[arg-type]
    assert len(fake.objects) == 1


def test_rejected_child_changes_nothing_and_is_reported_once(fake: FakeKube) -> None:
    posted: list[tuple[str, str]] = []
    first = run(fake, posted)
    config = dict(fake.objects[path("ConfigMap", "ns", "d-0-config")])
    cr = fake.objects[path(names.KIND, "ns", "d")]
    cr["metadata"]["generation"] = 2
    cr["spec"] = {"branchParallelism": 2, "decoding": {"branches": 2}, "resources": {"limits": {"cpu": "x"}}}
    fake.reject = (
        "StatefulSet",
        422,
        'StatefulSet.apps "d-0-worker" is invalid: ' + "cpu: Invalid value " * 80,
    )
    dry_runs = count_dry_runs(fake)
    for _ in range(2):  # the timer retries: one event, one status write
        run(fake, posted)  # nothing raised: kopf would hold the object's handlers and timer a minute
    # The refused rendering was tried once; the second resync refused it from the memo.
    assert dry_runs == [("Secret", "d-0-group"), ("ConfigMap", "d-0-config"), ("StatefulSet", "d-0-worker")]
    assert fake.objects[path("ConfigMap", "ns", "d-0-config")] == config  # the dry run stopped everything
    st = cr["status"]
    assert st["observedGeneration"] == 1 and st["configHash"] == first["configHash"]
    (cond,) = [c for c in st["conditions"] if c["type"] == "Reconciled"]
    assert cond["status"] == "False" and cond["reason"] == "ApplyFailed" and cond["observedGeneration"] == 2
    expected = 'apply StatefulSet d-0-worker: StatefulSet.apps "d-0-worker" is invalid'
    assert cond["message"].startswith(expected)
    assert len(cond["message"]) <= 1000 and cond["message"].endswith("...")
    assert [r for r, _ in posted].count("ApplyFailed") == 1

    # A 5xx is no spec error: it propagates for kopf's ordinary retry, without the condition.
    fake.memo.pop("refused")  # (as if RETRY_REFUSED_SECONDS had passed)
    fake.reject = ("StatefulSet", 500, "etcd timeout")
    with pytest.raises(KubeError):
        run(fake, posted)
    # ... but one for a key a child's schema lacks is the spec's (e.g. affinity.nodeAfinity, which the
    # CRD's open affinity admits): the condition names it.
    typed = ('failed to create typed patch object (ns/d-0-worker; apps/v1, Kind=StatefulSet): '
             '.spec.template.spec.affinity.nodeAfinity: field not declared in schema')
    fake.reject = ("StatefulSet", 500, typed)
    st = run(fake, posted)
    (cond,) = [c for c in st["conditions"] if c["type"] == "Reconciled"]
    assert cond["status"] == "False" and "nodeAfinity: field not declared in schema" in cond["message"]
    fake.memo.pop("refused")

    fake.reject = None  # the spec is fixed
    st = run(fake, posted)
    (cond,) = [c for c in st["conditions"] if c["type"] == "Reconciled"]
    assert cond["status"] == "True" and st["observedGeneration"] == 2


@pytest.mark.parametrize(("controller_uid", "kept"), [("cr-uid", False), ("another-cr", True)])
def test_a_deployment_wide_policy_goes_only_when_this_deployment_controls_it(
    controller_uid: str, kept: bool
) -> None:
    """One policy for all of a deployment's groups (named after it) admits every group's workers to
    every group's ports: the per-group policies replace it. A policy of that name that another owner
    controls is not the operator's to delete."""
    fake = FakeKube.with_deployment({"branchParallelism": 2, "replicas": 2})
    wide = path("NetworkPolicy", "ns", "d")
    owner = {"apiVersion": names.API_VERSION, "kind": names.KIND, "name": "x", "uid": controller_uid,
             "controller": True}
    fake.objects[wide] = {"kind": "NetworkPolicy",
                          "metadata": {"name": "d", "uid": "np-uid", "ownerReferences": [owner]}}
    run(fake, [])
    assert (wide in fake.objects) is kept
    assert sorted(fake.of_kind("NetworkPolicy")) == sorted(
        ["d-0-worker", "d-0-master", "d-1-worker", "d-1-master"] + (["d"] if kept else []))
    owner["uid"] = "cr-uid"
    fake.objects[wide] = {"kind": "NetworkPolicy",
                          "metadata": {"name": "d", "uid": "np-2", "ownerReferences": [owner]}}
    run(fake, [])  # looked for once per operator run and object (no GET every resync)
    assert wide in fake.objects


def test_a_removed_group_takes_its_policies_and_disabling_removes_them_all() -> None:
    fake = FakeKube.with_deployment({"branchParallelism": 1, "replicas": 2})
    run(fake, [])
    assert sorted(fake.of_kind("NetworkPolicy")) == ["d-0-master", "d-0-worker", "d-1-master", "d-1-worker"]
    fake.settle()
    cr = fake.objects[path(names.KIND, "ns", "d")]
    cr["spec"]["replicas"] = 1
    run(fake, [])
    assert sorted(fake.of_kind("NetworkPolicy")) == ["d-0-master", "d-0-worker"]
    cr["spec"]["networkPolicy"] = {"enabled": False}
    run(fake, [])
    assert fake.of_kind("NetworkPolicy") == {}
