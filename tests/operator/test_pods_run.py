"""End to end: the pods the operator renders run, form their group and answer.

The CPU sample (manifests/samples/cpu.yaml: 2 branch workers) is applied with the operator
running; the scheduler binds its pods to the process node of `kube.pod_runner` (the kwok nodes
are cordoned for this module), which runs each pod's container as a process in its own network
namespace: the real `lopa master` and `lopa worker`, with the command, env, ConfigMap mount, DNS
names, ports and probes the operator rendered. Requests go the way a client in the cluster sends
them: a client pod runs `lopa client generate` against the LoPADeployment's status.endpoint
(the client Service's name), resolved by the cluster DNS and forwarded by the Service proxy.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from lopa_op_helpers import (
    OperatorProcess,
    ask_client_pod,
    delete_all,
    is_available,
    load_sample,
    pods,
    process_node,
    wait_status,
)

from kube import netns
from kube.cluster import KubeCluster
from kube.pod_runner import PodRunner

pytestmark = pytest.mark.slow

NAME = "lopa-cpu"
PROMPT = "tail:gcecjki.ZVvrtus.WVbuklw="
GROUP_TIMEOUT = 240.0  # CPU workers loading torch and the model on a 2-core CI machine


@pytest.fixture(scope="module")
def runner(kube: KubeCluster) -> Iterator[PodRunner]:
    with process_node(kube) as pod_runner:
        yield pod_runner


@pytest.fixture(scope="module")
def ns(kube: KubeCluster, runner: PodRunner, operator: OperatorProcess) -> Iterator[str]:
    name = f"t-pods-run-{os.getpid()}"
    kube.kubectl("create", "namespace", name)
    # The rendered pods pass the restricted Pod Security Standard (the client pod below too).
    kube.kubectl("label", "namespace", name, "lopa.dev/test=true",
                 "pod-security.kubernetes.io/enforce=restricted")
    kube.wait_for(
        lambda: runner.api.get(f"/api/v1/namespaces/{name}/serviceaccounts/default"),
        timeout=30, description="the default ServiceAccount",
    )
    try:
        sample = load_sample("cpu.yaml")
        sample[0]["spec"]["branchParallelism"] = max(2, sample[0]["spec"].get("branchParallelism", 1))
        kube.apply(sample, namespace=name)
        yield name
    finally:
        print(f"--- operator log (tail) ---\n{chr(10).join(operator.log().splitlines()[-40:])}")
        print(runner.report())
        delete_all(kube, name)
        kube.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def expected() -> dict[int, dict[str, Any]]:
    """`lopa generate` on the bundled model with the sample's settings, per branch count."""
    out = {}
    for branches in (3, 0):
        result = subprocess.run(
            [sys.executable, "-m", "lopa", "generate", "--prompt", PROMPT, "--branches", str(branches),
             "--json"],
            capture_output=True, text=True, timeout=180, check=True,
        )
        out[branches] = json.loads(result.stdout)
    return out


def available(kube: KubeCluster, runner: PodRunner, ns: str, what: str) -> dict[str, Any]:
    return wait_group(kube, runner, ns, is_available, what)


def wait_group(
    kube: KubeCluster, runner: PodRunner, ns: str, check: Callable[[dict[str, Any]], bool], what: str
) -> dict[str, Any]:
    """wait_status with the runner's report (pod events, logs) in the failure message."""
    try:
        return wait_status(kube, ns, NAME, check, timeout=GROUP_TIMEOUT, description=what)
    except TimeoutError as error:
        raise TimeoutError(f"{error}\n{runner.report()}") from None


def ask(kube: KubeCluster, runner: PodRunner, ns: str, tag: str) -> dict[str, Any]:
    return ask_client_pod(kube, runner, ns, NAME, PROMPT, tag)


def workers(kube: KubeCluster, ns: str) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"]: p for p in pods(kube, ns, NAME, "worker")}


def test_sample_runs_serves_and_answers_like_lopa_generate(
    kube: KubeCluster, runner: PodRunner, ns: str, expected: dict[int, dict[str, Any]]
) -> None:
    obj = available(kube, runner, ns, "the CPU sample Available with its pods running as processes")
    assert obj["status"]["readyWorkers"] == 2
    group = workers(kube, ns)
    assert sorted(group) == [f"{NAME}-0-worker-0", f"{NAME}-0-worker-1"]
    (master,) = pods(kube, ns, NAME, "master")
    addresses = set()
    for pod in [*group.values(), master]:
        assert pod["spec"]["nodeName"] == runner.node
        assert runner.pid(ns, pod["metadata"]["name"]), f"{pod['metadata']['name']} has no process"
        addresses.add(pod["status"]["podIP"])
    assert len(addresses) == 3  # one network namespace (and address) per pod
    conditions = {c["type"]: c["status"] for c in master["status"]["conditions"]}
    assert conditions["Ready"] == "True"  # its gRPC readiness probe: grpc.health.v1 says SERVING
    answer = ask(kube, runner, ns, "first")
    assert answer["finish_reason"] == expected[3]["finish_reason"]
    assert answer["text"] == expected[3]["text"]
    assert answer["tokens"] == expected[3]["tokens"]
    # Lookahead branches granted per round: up to the 3 asked, fewer in rounds with few masked positions.
    assert 0 < answer["mean_branches"] <= 3
    assert answer["verified_tokens"] == expected[3]["verified_tokens"]  # alone: as `lopa generate`


def test_the_processes_see_their_group_secret_and_write_to_tmp(
    kube: KubeCluster, runner: PodRunner, ns: str
) -> None:
    """What the pods mount besides the config: the group Secret, read-only, and the emptyDir at /tmp
    that HOME and the caches point to (the root filesystem is read-only in a real container). The
    processes run as the non-root user 65532, which reads the Secret's owner-only (0400) files
    through the pod's fsGroup: root owns them, group 65532 may read them, nobody else."""
    available(kube, runner, ns, "the group Available")
    shared = base64.b64decode(kube.get_json("secret", f"{NAME}-0-group", "-n", ns)["data"]["secret"]).decode()
    for pod in pods(kube, ns, NAME) + pods(kube, ns, NAME, "master"):
        pid = runner.pid(ns, pod["metadata"]["name"])
        root = Path(f"/proc/{pid}/root")  # the process's own view of its mounts
        assert (root / "etc/lopa/group/secret").read_text() == shared
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        assert status["Uid"].split() == ["65532"] * 4 and status["Gid"].split() == ["65532"] * 4
        assert status["Groups"].split() == ["65532"]  # the fsGroup
        secret_file = (root / "etc/lopa/group/secret").stat()
        assert (secret_file.st_mode & 0o777, secret_file.st_uid, secret_file.st_gid) == (0o440, 0, 65532)
        lines = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
        mounts = {line.split()[4]: line.split()[5] for line in lines}  # mount point: options (last wins)
        assert mounts["/etc/lopa/group"].startswith("ro") and mounts["/tmp"].startswith("rw")
        variables = Path(f"/proc/{pid}/environ").read_text().split("\0")
        environ = dict(e.split("=", 1) for e in variables if "=" in e)
        assert environ["HOME"] == "/tmp" and environ["XDG_CACHE_HOME"].startswith("/tmp/")
        config = yaml.safe_load((root / "etc/lopa/lopa.yaml").read_text())
        assert config["workers"]["secret_file"] == "/etc/lopa/group/secret"


def test_a_killed_worker_restarts_the_whole_group(kube: KubeCluster, runner: PodRunner, ns: str,
                                                   expected: dict[int, dict[str, Any]]) -> None:
    before = available(kube, runner, ns, "the group Available before the kill")
    restarts = int(before["status"].get("groupRestarts") or 0)
    old = {name: pod["metadata"]["uid"] for name, pod in workers(kube, ns).items()}
    victim = f"{NAME}-0-worker-1"
    since = runner.api.request("GET", f"/api/v1/namespaces/{ns}/pods")["metadata"]["resourceVersion"]
    runner.kill(ns, victim, signal.SIGKILL)
    # Its pod reports the crash: Failed, its container terminated by SIGKILL. The StatefulSet
    # controller replaces a Failed pod at once, so the state is read from the watch, not a poll.
    seen = []
    for event in runner.api.watch(f"/api/v1/namespaces/{ns}/pods", since, 20,
                                  fieldSelector=f"metadata.name={victim}"):
        pod = event["object"]
        status = pod.get("status") or {}
        seen.append((event["type"], pod["metadata"]["uid"] == old[victim], status.get("phase")))
        terminated = (status.get("containerStatuses") or [{}])[0].get("state", {}).get("terminated") or {}
        if pod["metadata"]["uid"] == old[victim] and status.get("phase") == "Failed":
            assert terminated.get("exitCode") == 137
            break
    else:
        raise AssertionError(f"{victim} was never seen Failed: {seen}")
    after = wait_group(
        kube, runner, ns,
        lambda o: is_available(o) and int(o["status"].get("groupRestarts") or 0) > restarts,
        "the recreated group Available",
    )
    assert after["status"]["groupRestarts"] == restarts + 1
    new = {name: pod["metadata"]["uid"] for name, pod in workers(kube, ns).items()}
    assert sorted(new) == sorted(old)
    assert not set(new.values()) & set(old.values())  # every worker recreated, not only the victim
    answer = ask(kube, runner, ns, "after-restart")
    assert answer["text"] == expected[3]["text"]
    # Every pod the operator deleted stopped on SIGTERM (a container's PID 1 ignores it by default).
    assert runner.grace_kills == []


def test_a_decoding_change_rolls_the_group_and_shows_in_the_answer(
    kube: KubeCluster, runner: PodRunner, ns: str, expected: dict[int, dict[str, Any]]
) -> None:
    before = available(kube, runner, ns, "the group Available before the change")
    old = {p["metadata"]["uid"] for p in pods(kube, ns, NAME) + pods(kube, ns, NAME, "master")}
    kube.kubectl("patch", "lopadeployment", NAME, "-n", ns, "--type=merge",
                 "-p", json.dumps({"spec": {"decoding": {"branches": 0}}}))
    after = wait_group(
        kube, runner, ns,
        lambda o: is_available(o) and o["status"]["configHash"] != before["status"]["configHash"],
        "the rolled group Available",
    )
    assert after["status"]["groupRestarts"] == before["status"]["groupRestarts"]  # a roll is no failure
    now = {p["metadata"]["uid"] for p in pods(kube, ns, NAME) + pods(kube, ns, NAME, "master")}
    assert not now & old
    answer = ask(kube, runner, ns, "d2f")
    assert answer["mean_branches"] == 0
    assert answer["text"] == expected[0]["text"]
    assert answer["tokens"] == expected[0]["tokens"]
    assert runner.grace_kills == []
    # The old master waited out its preStop sleep before SIGTERM (out of the Service first).
    assert any("-master-" in e and "preStop sleep 5s" in e for e in runner.events), runner.report()


def test_stop_leaves_no_process_namespace_or_node(kube: KubeCluster, runner: PodRunner, ns: str) -> None:
    group = pods(kube, ns, NAME) + pods(kube, ns, NAME, "master")
    pids = [runner.pid(ns, p["metadata"]["name"]) for p in group]
    assert all(pids) and runner.running() >= 3
    started = time.monotonic()
    runner.stop()  # what the fixture's teardown (and atexit) does when a test fails
    assert time.monotonic() - started < 30
    for pid in pids:
        assert pid is not None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    left = netns.ip("netns", "list").stdout
    assert f"lopa-{os.getpid()}-" not in left
    assert netns.ip("link", "show", runner.network.bridge, check=False).returncode != 0
    assert runner.api.get(f"/api/v1/nodes/{runner.node}") is None
