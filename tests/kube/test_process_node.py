"""The process-node harness's own parts, without a control plane: `$(VAR)` expansion, the pod
sandbox (volumes at their mount paths, hostname, cluster names through the DNS server's search
list) and the removal of what a SIGKILLed run left behind."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from kube import cluster_dns, netns, pod_sandbox
from kube.pod_plan import Mount, PodPlan, User, expand, user
from kube.pod_runner import container_pid

needs_netns = pytest.mark.skipif(bool(netns.available()), reason=f"pod networks: {netns.available()}")


def test_expand_follows_kubernetes_rules() -> None:
    env = {"RANK": "1", "EMPTY": ""}
    assert expand("--rank=$(RANK)", env) == "--rank=1"
    assert expand("$$(RANK) $(MISSING) $(EMPTY)x", env) == "$(RANK) $(MISSING) x"
    assert expand("$(RANK", env) == "$(RANK"
    assert expand("a$b$", env) == "a$b$"


def _plan(argv: list[str], share_pid: bool = False) -> PodPlan:
    return PodPlan(share_pid=share_pid,
        uid="u1", name="w-0", namespace="ns1", container="c", argv=argv,
        env={"PATH": "/usr/bin:/bin", "GREETING": "hi"}, ports={},
        mounts=[
            Mount("config", "/etc/lopa-harness-test", read_only=True),
            Mount("scratch", "/etc/lopa-harness-test/inner"),
        ],
        volumes={"config": {"lopa.yaml": (b"k: v\n", 0o644)}, "scratch": {}},
        readiness=None, liveness=None, hostname="w-0", subdomain="ws", grace_seconds=30, working_dir="/",
    )


@needs_netns
def test_sandbox_has_volumes_hostname_and_cluster_names(tmp_path: Path) -> None:
    network = netns.PodNetwork()
    records = {"w-1.ws.ns1.svc.cluster.local": ["10.9.8.7"], "empty.ns1.svc.cluster.local": []}
    dns = cluster_dns.ClusterDNS(network.gateway, records.get)
    try:
        name, address = network.add()
        script = """
            hostname; echo $GREETING; cat /etc/lopa-harness-test/lopa.yaml
            touch /etc/lopa-harness-test/x 2>/dev/null && echo writable || echo read-only
            touch /etc/lopa-harness-test/inner/x && echo inner-writable
            getent hosts w-0 | cut -f1 -d' '
            getent hosts w-1.ws.ns1.svc | cut -f1 -d' '
            getent hosts empty.ns1.svc || echo no-address
            getent hosts example.com || echo outside
        """
        plan = _plan(["sh", "-c", textwrap.dedent(script)])
        netns_path = network.netns_path(name)
        argv = pod_sandbox.prepare(plan, tmp_path, netns_path, address, network.gateway, {"config"})
        result = subprocess.run(argv, env=plan.env, capture_output=True, text=True, timeout=30, check=False)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == [
            "w-0", "hi", "k:", "v", "read-only", "inner-writable",
            address, "10.9.8.7", "no-address", "outside",
        ]
        assert not Path("/etc/lopa-harness-test").exists()  # the mount point lived in the pod's overlay
    finally:
        dns.close()
        network.close()


@needs_netns
@pytest.mark.parametrize("fs_group", [65532, None])
def test_the_container_runs_as_its_user_and_reads_an_owner_only_secret_through_fs_group(
    tmp_path: Path, fs_group: int | None
) -> None:
    """runAsUser/runAsGroup and fsGroup as a kubelet applies them: a Secret file of mode 0400 (owned
    by root) is readable by the non-root user through fsGroup (0440, that group), and not without;
    the emptyDir is writable by that user."""
    network = netns.PodNetwork()
    try:
        name, address = network.add()
        script = """
            id -u; id -g; id -G
            cat /etc/lopa-harness-test/secret 2>/dev/null || echo unreadable
            touch /etc/lopa-harness-test/inner/x && echo inner-writable
            stat -c %a:%u:%g /etc/lopa-harness-test/secret
        """
        plan = _plan(["sh", "-c", textwrap.dedent(script)])
        plan.volumes["config"] = {"secret": (b"s3cret\n", 0o400)}
        groups = (fs_group,) if fs_group is not None else ()
        plan.user, plan.fs_group = User(65532, 65532, groups), fs_group
        netns_path = network.netns_path(name)
        argv = pod_sandbox.prepare(plan, tmp_path, netns_path, address, network.gateway, {"config"})
        result = subprocess.run(argv, env=plan.env, capture_output=True, text=True, timeout=30, check=False)
        assert result.returncode == 0, result.stderr
        seen = "s3cret" if fs_group else "unreadable"
        mode = "440:0:65532" if fs_group else "400:0:0"
        assert result.stdout.split() == ["65532", "65532", "65532", seen, "inner-writable", mode]
    finally:
        network.close()


@needs_netns
def test_code_under_a_directory_only_root_enters_is_reached_by_the_pods_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkout under /root (0700) runs pods as their non-root user: in the pod the directories
    on the way to the code can be entered (not listed); on the host they keep their mode."""
    private = Path(tempfile.mkdtemp(prefix="lopa-private-"))  # 0700, as /root
    network = netns.PodNetwork()
    try:
        code = private / "checkout"
        code.mkdir()
        (code / "file").write_text("code\n")
        monkeypatch.setattr(pod_sandbox, "HOST_CODE", (*pod_sandbox.HOST_CODE, code))
        name, address = network.add()
        # As its own group, and as root's group (runAsUser without runAsGroup): judged by the
        # group bits, not the others'.
        for index, gid in enumerate((65532, 0)):
            plan = _plan(["sh", "-c", f"cat {code}/file; ls {private} >/dev/null 2>&1 || echo unlisted"])
            plan.user = User(65532, gid, ())
            argv = pod_sandbox.prepare(plan, tmp_path / str(index), network.netns_path(name), address,
                                       network.gateway, {"config"})
            result = subprocess.run(argv, env=plan.env, capture_output=True, text=True, timeout=30,
                                    check=False)
            assert result.returncode == 0, result.stderr
            assert result.stdout.split() == ["code", "unlisted"], gid
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
    finally:
        network.close()
        shutil.rmtree(private)


def test_the_user_comes_from_the_security_contexts() -> None:
    pod = {"securityContext": {"runAsUser": 1000, "runAsGroup": 2000, "fsGroup": 3000,
                               "supplementalGroups": [4000, 3000]}}
    assert user(pod, {}) == User(1000, 2000, (3000, 4000))
    assert user(pod, {"securityContext": {"runAsUser": 7, "runAsGroup": 8}}) == User(7, 8, (3000, 4000))
    assert user({}, {}) is None  # root, as an image without USER


LEAVER = """
import subprocess, sys, time
from kube import netns
from kube.processes import die_with_parent
network = netns.PodNetwork()
name, _ = network.add()
argv = ["nsenter", f"--net={network.netns_path(name)}", "sleep", "300"]
child = subprocess.Popen(argv, preexec_fn=die_with_parent)
print(name, network.bridge, child.pid, flush=True)
time.sleep(300)
"""


@needs_netns
def test_a_sigkilled_run_leaves_nothing_for_long() -> None:
    tests_dir = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")])}
    leaver = subprocess.Popen([sys.executable, "-c", LEAVER], stdout=subprocess.PIPE, text=True, env=env)
    assert leaver.stdout is not None
    name, bridge, child = leaver.stdout.readline().split()
    leaver.send_signal(signal.SIGKILL)
    leaver.wait(timeout=10)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{child}").exists()  # died with its parent (PR_SET_PDEATHSIG)
    # The namespace and the bridge are left behind until a run sweeps them: this one now (or another
    # test process that started a pod network meanwhile).
    netns.remove_stale()
    assert name not in netns.ip("netns", "list").stdout
    assert netns.ip("link", "show", bridge, check=False).returncode != 0


@needs_netns
@pytest.mark.parametrize("share", [False, True])
def test_the_container_is_pid_1_unless_the_pod_shares_its_pid_namespace(tmp_path: Path, share: bool) -> None:
    network = netns.PodNetwork()
    try:
        name, address = network.add()
        plan = _plan(["sh", "-c", "echo pid $$; exec sleep 60"], share_pid=share)
        argv = pod_sandbox.prepare(plan, tmp_path, network.netns_path(name), address, network.gateway, set())
        process = subprocess.Popen(argv, env=plan.env, stdout=subprocess.PIPE, text=True)
        assert process.stdout is not None
        pid = container_pid(process, tmp_path / pod_sandbox.LAUNCHED if share else None)
        ns_pid = process.stdout.readline().split()
        assert (ns_pid[1] != "1") if share else (ns_pid == ["pid", "1"])
        os.kill(pid, signal.SIGTERM)
        if share:  # beside a "pause", SIGTERM's default action applies: the container dies of it
            assert process.wait(timeout=10) == 128 + signal.SIGTERM  # the "pause" exits 128 + n
        else:  # PID 1 without a handler ignores it, as in a container
            with pytest.raises(subprocess.TimeoutExpired):
                process.wait(timeout=1)
            os.kill(pid, signal.SIGKILL)
            assert process.wait(timeout=10) == -signal.SIGKILL  # the launcher ends as its child did
    finally:
        network.close()


@needs_netns
def test_an_empty_dir_over_the_pods_own_directory_keeps_the_other_volumes(tmp_path: Path) -> None:
    """A pod's emptyDir at /tmp, where the harness keeps the pod's files (pytest's tmp_path here,
    the cluster's work dir in a run): the volumes nested in it and beside it are still mounted, and
    the "pause" still reports its container. A checkout or venv under /tmp stays visible there (the
    harness binds the code a pod runs from), so the listing holds `conf` and those entries only."""
    assert tmp_path.is_relative_to("/tmp")
    host_code = {p.relative_to("/tmp").parts[0] for p in pod_sandbox.HOST_CODE if p.is_relative_to("/tmp")}
    network = netns.PodNetwork()
    try:
        name, address = network.add()
        script = """
            ls -A /tmp | paste -sd/ -; cat /tmp/conf/lopa.yaml /etc/lopa-harness-test/lopa.yaml
            touch /tmp/conf/x 2>/dev/null && echo writable || echo read-only
            touch /tmp/y && echo tmp-writable; exec sleep 60
        """
        plan = _plan(["sh", "-c", textwrap.dedent(script)], share_pid=True)
        plan.mounts += [Mount("tmp", "/tmp"), Mount("config", "/tmp/conf", read_only=True)]
        plan.volumes["tmp"] = {}
        argv = pod_sandbox.prepare(plan, tmp_path, network.netns_path(name), address, network.gateway,
                                   {"config"})
        process = subprocess.Popen(argv, env=plan.env, stdout=subprocess.PIPE, text=True)
        assert process.stdout is not None
        pid = container_pid(process, tmp_path / pod_sandbox.LAUNCHED)
        listing, *lines = [process.stdout.readline().rstrip("\n") for _ in range(5)]
        assert set(listing.split("/")) == {"conf", *host_code}
        assert lines == ["k: v", "k: v", "read-only", "tmp-writable"]
        assert pid != process.pid and (tmp_path / "volumes" / "tmp" / "y").exists()
        os.kill(pid, signal.SIGKILL)
        process.wait(timeout=10)
    finally:
        network.close()
