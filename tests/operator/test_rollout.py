"""Replicas of groups without a cluster: the rollout plan (pure) and reconcile over an in-memory API.

The in-memory API's settle() stands in for the controllers and kubelets, so a whole rollout can
be stepped reconcile by reconcile and every intermediate status checked.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from fake_kube import FakeKube

from lopa_operator import names, reconcile, rollout
from lopa_operator.kube import path


def deployed(*groups: tuple[str, bool], workers: int = 2) -> dict[int, rollout.Deployed]:
    return {
        i: rollout.Deployed(i, worker_hash=h, master_hash=h, workers=workers, available=up)
        for i, (h, up) in enumerate(groups)
    }


def test_current_groups_are_all_rendered() -> None:
    plan = rollout.plan(deployed(("new", True), ("new", True)), 2, "new", 1)
    assert plan == rollout.Plan(update=(0, 1), hold=(), remove=())


def test_one_available_stale_group_rolls_at_a_time() -> None:
    plan = rollout.plan(deployed(("old", True), ("old", True), ("old", True)), 3, "new", 1)
    assert plan.update == (0,) and plan.hold == (1, 2)
    plan = rollout.plan(deployed(("old", True), ("old", True), ("old", True)), 3, "new", 2)
    assert plan.update == (0, 1) and plan.hold == (2,)


def test_a_group_down_anyway_rolls_first_and_uses_the_budget() -> None:
    plan = rollout.plan(deployed(("old", True), ("old", False), ("old", True)), 3, "new", 1)
    assert plan.update == (1,) and plan.hold == (0, 2)
    # a rolled group that is not back yet holds the others
    plan = rollout.plan(deployed(("new", False), ("old", True), ("old", True)), 3, "new", 1)
    assert plan.update == (0,) and plan.hold == (1, 2)


def test_new_groups_are_created_and_count_as_down() -> None:
    plan = rollout.plan(deployed(("old", True)), 3, "new", 1)
    assert plan.update == (1, 2) and plan.hold == (0,)


def test_a_group_with_one_stale_child_is_stale() -> None:
    mixed = {0: rollout.Deployed(0, worker_hash="new", master_hash="old", workers=2, available=True)}
    assert rollout.plan(mixed, 1, "new", 1).update == (0,)
    assert not mixed[0].runs("new")


def test_scale_down_removes_the_highest_groups() -> None:
    plan = rollout.plan(deployed(("new", True), ("new", True), ("new", True)), 1, "new", 1)
    assert plan == rollout.Plan(update=(0,), hold=(), remove=(2, 1))


# -- reconcile over the in-memory API ------------------------------------------------------------


@pytest.fixture
def fake() -> FakeKube:
    return FakeKube.with_deployment({"branchParallelism": 2, "replicas": 3})


def step(fake: FakeKube, posted: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    def post(obj: dict[str, Any], kind: str, reason: str, message: str) -> None:
        if posted is not None:
            posted.append((reason, message))

    out = reconcile.reconcile(fake, "ns", "d", "test", post, logging.getLogger("test"), fake.memo)  # type: ignore[arg-type]
    assert out is not None
    fake.settle()
    return out


def cr(fake: FakeKube) -> dict[str, Any]:
    return fake.objects[path(names.KIND, "ns", "d")]


def change_spec(fake: FakeKube, **spec: Any) -> None:
    obj = cr(fake)
    obj["spec"] = {**obj["spec"], **spec}
    obj["metadata"]["generation"] += 1


def serving(fake: FakeKube) -> dict[str, Any]:
    for _ in range(4):
        status = step(fake)
    assert status["phase"] == "Available", status
    return status


def test_three_groups_each_with_its_own_children(fake: FakeKube) -> None:
    status = serving(fake)
    assert status["ready"] == "3/3" and status["readyReplicas"] == status["replicas"] == 3
    assert status["readyWorkers"] == status["workers"] == 6
    assert status["selector"] == names.selector("d", names.ROLE_MASTER)
    assert [g["index"] for g in status["groups"]] == [0, 1, 2]
    assert all(g["available"] and g["ready"] == "2/2" for g in status["groups"])
    assert sorted(fake.of_kind("StatefulSet")) == ["d-0-worker", "d-1-worker", "d-2-worker"]
    assert sorted(fake.of_kind("Deployment")) == ["d-0-master", "d-1-master", "d-2-master"]
    for index in range(3):
        config = fake.of_kind("ConfigMap")[f"d-{index}-config"]["data"][names.CONFIG_FILE]
        assert f"d-{index}-worker-1.d-workers.ns.svc:50052" in config  # each group dials its own workers
    client = fake.of_kind("Service")["d"]
    assert client["spec"]["selector"] == names.labels("d", names.ROLE_MASTER)  # every group's master


def test_a_lost_worker_restarts_its_group_only(fake: FakeKube) -> None:
    serving(fake)
    pods_before = fake.of_kind("Pod")
    del fake.objects[path("Pod", "ns", "d-2-worker-0")]
    fake.settle()
    fake.deleted.clear()
    status = step(fake)
    assert sorted(fake.deleted) == ["d-2-worker-0", "d-2-worker-1"]
    assert [g["restarts"] for g in status["groups"]] == [0, 0, 1] and status["groupRestarts"] == 1
    assert [g["available"] for g in status["groups"]] == [True, True, False]
    status = serving(fake)
    after = fake.of_kind("Pod")
    for name in after:
        if not name.startswith("d-2-worker"):
            assert after[name]["metadata"]["uid"] == pods_before[name]["metadata"]["uid"], name


def test_a_spec_change_rolls_one_group_at_a_time(fake: FakeKube) -> None:
    before = serving(fake)
    change_spec(fake, decoding={"tauConf": 0.8})
    posted: list[tuple[str, str]] = []
    seen_down, rolled_at = [], {}
    for round_ in range(30):
        status = step(fake, posted)
        down = [g["index"] for g in status["groups"] if not g["available"]]
        seen_down.append(len(down))
        for g in status["groups"]:
            if g["configHash"] == status["configHash"]:
                rolled_at.setdefault(g["index"], round_)
        if status["phase"] == "Available" and status["updatedReplicas"] == 3:
            break
    assert max(seen_down) == 1, seen_down  # never more than maxUnavailable groups down
    assert status["configHash"] != before["configHash"] and status["groupRestarts"] == 0
    assert all(g["configHash"] == status["configHash"] and g["available"] for g in status["groups"])
    assert sorted(rolled_at.values()) == list(rolled_at.values()) and len(set(rolled_at.values())) == 3
    # The deployment stays Available through the roll: 2 of 3 groups serve at every step.
    assert any(reason == "RollingGroup" and message.startswith("group ") for reason, message in posted)
    for index in range(3):
        template = fake.of_kind("StatefulSet")[f"d-{index}-worker"]["spec"]["template"]
        assert template["metadata"]["annotations"][names.CONFIG_HASH_ANNOTATION] == status["configHash"]


def test_max_unavailable_two_rolls_two_groups_together(fake: FakeKube) -> None:
    serving(fake)
    change_spec(fake, decoding={"tauConf": 0.8}, rollout={"maxUnavailable": 2})
    status = step(fake)
    assert sum(not g["available"] for g in status["groups"]) == 2


def test_a_held_group_keeps_its_config_until_its_turn(fake: FakeKube) -> None:
    serving(fake)
    old = {n: c["data"] for n, c in fake.of_kind("ConfigMap").items()}
    change_spec(fake, branchParallelism=3)
    status = step(fake)
    held = [g for g in status["groups"] if g["configHash"] != status["configHash"]]
    assert len(held) == 2 and all(g["available"] and g["ready"] == "2/2" for g in held)
    for g in held:
        name = f"d-{g['index']}-config"
        assert fake.of_kind("ConfigMap")[name]["data"] == old[name]
        assert fake.of_kind("StatefulSet")[f"d-{g['index']}-worker"]["spec"]["replicas"] == 2


def test_scale_down_removes_the_children_of_the_highest_groups(fake: FakeKube) -> None:
    serving(fake)
    posted: list[tuple[str, str]] = []
    change_spec(fake, replicas=1)
    status = step(fake, posted)
    assert sorted(fake.of_kind("StatefulSet")) == ["d-0-worker"]
    assert sorted(fake.of_kind("Deployment")) == ["d-0-master"]
    assert sorted(fake.of_kind("ConfigMap")) == ["d-0-config"]
    assert all(name.startswith("d-0-") for name in fake.of_kind("Pod"))
    assert status["replicas"] == 1 and status["ready"] == "1/1" and len(status["groups"]) == 1
    assert ("ScaledDown", "removed group(s) 2, 1 (spec.replicas)") in posted


def test_a_group_lost_since_the_last_status_counts_as_down(fake: FakeKube) -> None:
    serving(fake)
    # A worker of group 2 goes between two reconciles; then the spec changes: the status still says
    # group 2 serves, its pods do not, so no other group may roll in the same pass.
    del fake.objects[path("Pod", "ns", "d-2-worker-0")]
    change_spec(fake, decoding={"tauConf": 0.8})
    status = reconcile.reconcile(fake, "ns", "d", "test", lambda *a: None, logging.getLogger("t"), fake.memo)  # type: ignore[arg-type]
    assert status is not None
    assert [g["configHash"] == status["configHash"] for g in status["groups"]] == [False, False, True]


def test_scaling_keeps_an_exhausted_group_degraded(fake: FakeKube) -> None:
    change_spec(fake, failurePolicy={"maxGroupRestarts": 0})
    serving(fake)
    del fake.objects[path("Pod", "ns", "d-1-worker-0")]
    fake.settle()
    assert step(fake)["phase"] == "Degraded"
    change_spec(fake, replicas=2)  # a scale bumps the generation, not the config
    assert step(fake)["phase"] == "Degraded"


def test_scale_to_zero_and_back(fake: FakeKube) -> None:
    serving(fake)
    change_spec(fake, replicas=0)
    status = step(fake)
    assert status["replicas"] == 0 and status["groups"] == [] and not fake.of_kind("Pod")
    assert status["ready"] == "0/0"
    change_spec(fake, replicas=2)
    assert serving(fake)["ready"] == "2/2"


def test_children_of_an_operator_without_groups_are_replaced(fake: FakeKube) -> None:
    legacy = {
        "metadata": {"name": "d-worker", "labels": names.labels("d", names.ROLE_WORKER), "uid": "x"},
        "spec": {
            "replicas": 2,
            "template": {"metadata": {"labels": names.labels("d", names.ROLE_WORKER), "annotations": {}}},
        },
    }
    fake.objects[path("StatefulSet", "ns", "d-worker")] = legacy
    fake.objects[path("ConfigMap", "ns", "d-config")] = {
        "metadata": {"name": "d-config", "labels": names.labels("d"), "uid": "y"}
    }
    fake.settle()
    # The first reconcile creates the groups; the old children serve until enough groups do.
    status = step(fake)
    assert status["readyReplicas"] == 0 and "d-worker" in fake.of_kind("StatefulSet")
    serving(fake)
    assert "d-worker" not in fake.of_kind("StatefulSet") and "d-config" not in fake.of_kind("ConfigMap")
