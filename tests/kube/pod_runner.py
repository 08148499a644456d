"""Runs, as local processes, the pods the scheduler binds to one node of the test cluster.

`PodRunner(kube).start()` registers a Node that kwok does not manage (`process_node`), a pod network
(`netns`), a cluster DNS (`cluster_dns`) and a Service proxy (`service_proxy`), then a loop plays
the kubelet of that node, every `TICK_SECONDS`:
- a new pod bound to the node gets its own network namespace and address, its container is
  planned from the Pod object (`pod_plan`: argv, env, volumes) and started as a process in its
  sandbox (`pod_sandbox`: the namespaces, mounts, /etc/hosts and resolv.conf), then probed
  (`prober`); a pod whose ConfigMap or Secret is missing waits, as with a kubelet;
- its status is patched through the API server as a kubelet reports it (`pod_status`): Running with
  its podIP, Ready from the readiness probe, Succeeded/Failed with the exit code once the process
  exits;
- a pod being deleted waits out its preStop sleep, gets SIGTERM, then SIGKILL once its grace
  period is over, then its object is deleted (grace 0), as the kubelet finishes a deletion; a
  pod that vanished is killed;
- Services and EndpointSlices of the namespaces of its pods are re-read for the DNS and the proxy.

`stop()` (also at exit, and by `with`) kills every process, deletes every namespace, the bridge and
the Node; the pods' files (volumes, logs) stay in the cluster's work dir, removed with it.
Processes are started from the loop's thread with PR_SET_PDEATHSIG, so they die with the test
process even when it is SIGKILLed; namespaces and bridges carry its pid and the next run removes
such leftovers (`netns.remove_stale`).

Where it differs from a kubelet (besides what the helper modules say): the pod list is polled, not
watched; exited containers are not restarted (`pod_status`); images, resources, startupProbe, init
containers, several containers per pod and preStop hooks other than sleep are not supported; it
runs as the cluster admin.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from . import cluster_dns, netns, pod_plan, pod_sandbox, pod_status, process_node, services
from .cluster import KubeCluster
from .errors import KubeClusterError
from .kube_api import Api, ApiError
from .prober import Prober
from .processes import die_with_parent, tail
from .service_proxy import ServiceProxy

TICK_SECONDS = 0.3
NODE_NAME = "lopa-processes"


@dataclass
class _Pod:
    """One pod incarnation (uid) that the runner started."""

    namespace: str
    name: str
    uid: str
    netns: str
    ip: str
    plan: pod_plan.PodPlan
    process: subprocess.Popen[bytes]
    log: IO[bytes]
    log_path: Path
    container: pod_status.ContainerState
    prober: Prober
    pid: int  # the container's process (PID 1 of its PID namespace, or a child of a "pause")
    reported: dict[str, Any] | None = None
    term_deadline: float | None = None  # set once SIGTERM was sent
    stop_asked: float | None = None  # when its deletion was seen (its preStop hook runs from then)


@dataclass
class PodRunner:
    kube: KubeCluster
    node: str = NODE_NAME
    work_dir: Path | None = None  # default: <the cluster's work dir>/pods, removed with it
    events: list[str] = field(default_factory=list)  # what it did, for failure messages
    # Containers still alive when their grace period ran out (SIGKILLed), as "namespace/name".
    grace_kills: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.work_dir = Path(self.work_dir or self.kube.work_dir / "pods")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.api = Api(self.kube.kubeconfig)
        self._pods: dict[str, _Pod] = {}  # uid -> running (or exited, not yet deleted) pod
        self._waiting: dict[str, str] = {}  # uid -> why it has not started yet
        self._logs: dict[tuple[str, str], Path] = {}  # (namespace, name) -> latest incarnation's log
        self._records: dict[str, list[str]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_renew = 0.0
        self._stopped = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> PodRunner:
        why = netns.available()
        if why:
            raise KubeClusterError(f"the process node {why}")
        atexit.register(self.stop)
        try:
            self.network = netns.PodNetwork()
            self.dns = cluster_dns.ClusterDNS(self.network.gateway, self._lookup)
            self.proxy = ServiceProxy(self.network.add_vip)
            process_node.register(self.api, self.node, self.network.gateway)
        except BaseException:
            self.stop()
            raise
        self._thread = threading.Thread(target=self._loop, name="pod-runner", daemon=True)
        self._thread.start()
        return self

    def __enter__(self) -> PodRunner:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Kills every process, removes every namespace, the bridge and the Node. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for pod in list(self._pods.values()):
            self._cleanup(pod)
        for part in ("proxy", "dns", "network"):
            if hasattr(self, part):
                with contextlib.suppress(Exception):
                    getattr(self, part).close()
        with contextlib.suppress(Exception):
            process_node.unregister(self.api, self.node)
        self.api.close()
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)

    # ------------------------------------------------------------------ for tests

    def pid(self, namespace: str, name: str) -> int | None:
        """The pid of the running container process of pod `name`, if any."""
        for pod in list(self._pods.values()):
            if (pod.namespace, pod.name) == (namespace, name) and pod.process.poll() is None:
                return pod.pid
        return None

    def kill(self, namespace: str, name: str, sig: int = signal.SIGKILL) -> int:
        """Signals pod `name`'s container process (as if it crashed); returns its pid."""
        pid = self.pid(namespace, name)
        if pid is None:
            raise KubeClusterError(f"pod {namespace}/{name} has no running process")
        os.kill(pid, sig)
        return pid

    def log(self, namespace: str, name: str, lines: int = 60) -> str:
        """The last lines of the output of pod `name`'s latest container."""
        path = self._logs.get((namespace, name))
        return tail(path, lines) if path else f"(pod {namespace}/{name} never ran here)"

    def report(self) -> str:
        """What the runner did and runs now, and every pod log's tail: for a failed test's message."""
        parts = ["--- pod runner events ---", *self.events[-80:]]
        parts += [f"waiting {uid}: {why}" for uid, why in self._waiting.items()]
        for (namespace, name), path in sorted(self._logs.items()):
            parts += [f"--- {namespace}/{name} ({path}) ---", tail(path, 25)]
        return "\n".join(parts)

    def running(self) -> int:
        return sum(1 for pod in self._pods.values() if pod.process.poll() is None)

    # ------------------------------------------------------------------ the loop

    def _event(self, text: str) -> None:
        self.events.append(f"{time.strftime('%H:%M:%S')} {text}")

    def _lookup(self, name: str) -> list[str] | None:
        return self._records.get(name)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick()
            except Exception as error:  # an API hiccup: the next tick retries
                self._event(f"tick failed: {error!r}")
            self._stop.wait(TICK_SECONDS)

    def _tick(self) -> None:
        if time.monotonic() - self._last_renew >= process_node.RENEW_SECONDS:
            process_node.renew(self.api, self.node)
            self._last_renew = time.monotonic()
        listed = self.api.items("/api/v1/pods", fieldSelector=f"spec.nodeName={self.node}")
        seen = set()
        for obj in listed:
            uid = obj["metadata"]["uid"]
            seen.add(uid)
            pod = self._pods.get(uid)
            if obj["metadata"].get("deletionTimestamp"):
                self._terminate(obj, pod)
            elif pod is None:
                if (obj.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                    self._start(obj)
            else:
                self._poll(pod)
                self._report(obj, pod)
        for uid in set(self._pods) - seen:  # deleted with grace 0 by someone else
            self._event(f"{self._pods[uid].name}: gone from the API server; killing")
            self._cleanup(self._pods[uid])
        namespaces = {obj["metadata"]["namespace"] for obj in listed}
        views = services.snapshot(self.api, namespaces)
        self.proxy.sync(views)
        self._records = cluster_dns.records(views, self.proxy.vip)

    def _start(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        uid, where = meta["uid"], f"{meta['namespace']}/{meta['name']}"
        if any("startupProbe" in c for c in obj["spec"]["containers"]):
            self._refuse(obj, "startupProbe is not supported")
            return
        name, address = self.network.add()
        assert self.work_dir is not None
        pod_dir = self.work_dir / f"{meta['namespace']}_{meta['name']}_{uid[:8]}"
        try:
            plan = pod_plan.plan(obj, self.api, address, self.network.gateway)
            argv = pod_sandbox.prepare(
                plan, pod_dir, self.network.netns_path(name), address, self.network.gateway,
                pod_sandbox.read_only_volumes(obj),
            )
        except (pod_plan.NotYet, ApiError) as error:  # e.g. the ConfigMap is not there yet: retry
            self.network.remove(name, address)
            if self._waiting.get(uid) != str(error):
                self._event(f"{where}: waiting: {error}")
            self._waiting[uid] = str(error)
            return
        except pod_plan.Unsupported as error:
            self.network.remove(name, address)
            self._refuse(obj, str(error))
            return
        self._waiting.pop(uid, None)
        log_path = pod_dir / "container.log"
        log = log_path.open("ab")
        process = subprocess.Popen(
            argv, env=plan.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd="/",
            start_new_session=True,  # its own process group, like a container's processes
            preexec_fn=die_with_parent,  # dies with the test process, however it dies
        )
        pid = container_pid(process, pod_dir / pod_sandbox.LAUNCHED if plan.share_pid else None)
        image = obj["spec"]["containers"][0].get("image", "")
        container = pod_status.ContainerState(plan.container, f"process://{pid}", image, pod_status.now())
        pod = _Pod(meta["namespace"], meta["name"], uid, name, address, plan, process, log, log_path,
                   container, Prober(plan, address, pid, self._probe_event(where)), pid)
        self._pods[uid] = pod
        self._logs[(pod.namespace, pod.name)] = log_path
        self._event(f"{where}: started pid {pid} at {address}: {' '.join(plan.argv)}")
        self._report(obj, pod)

    def _probe_event(self, where: str) -> Callable[[str, bool, str], None]:
        def note(kind: str, ok: bool, why: str) -> None:
            self._event(f"{where}: {kind} {'succeeded' if ok else 'failed: ' + why}")

        return note

    def _refuse(self, obj: dict[str, Any], why: str) -> None:
        """A pod the harness cannot run stays Pending with the reason in its container status."""
        meta = obj["metadata"]
        if self._waiting.get(meta["uid"]) == why:
            return
        self._waiting[meta["uid"]] = why
        self._event(f"{meta['namespace']}/{meta['name']}: cannot run: {why}")
        name = obj["spec"]["containers"][0]["name"]
        waiting = {"waiting": {"reason": "CreateContainerConfigError", "message": why}}
        patch = {"containerStatuses": [{"name": name, "image": "", "imageID": "", "ready": False,
                                        "restartCount": 0, "state": waiting}]}
        with contextlib.suppress(ApiError):
            self.api.patch(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                           {"status": patch})

    def _poll(self, pod: _Pod) -> None:
        code = pod.process.poll()
        if code is not None and pod.container.exit_code is None:
            pod.container.exit_code = code if code >= 0 else 128 - code  # killed by a signal: 128 + n
            pod.container.finished_at = pod_status.now()
            pod.prober.stop()
            pod.log.close()
            self._event(f"{pod.namespace}/{pod.name}: pid {pod.pid} exited {pod.container.exit_code}")
            return
        if code is None and not pod.prober.state.live and pod.term_deadline is None:
            pod.container.message = pod.prober.state.last_error
            self._event(f"{pod.namespace}/{pod.name}: {pod.container.message}; stopping")
            self._signal(pod, pod.plan.grace_seconds)
        if code is None and pod.term_deadline is not None and time.monotonic() >= pod.term_deadline:
            pod.term_deadline = float("inf")  # once
            self.grace_kills.append(f"{pod.namespace}/{pod.name}")
            self._event(f"{pod.namespace}/{pod.name}: still running after its grace period; SIGKILL")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pod.process.pid, signal.SIGKILL)
        pod.container.ready = pod.prober.state.ready

    def _report(self, obj: dict[str, Any], pod: _Pod) -> None:
        patch = pod_status.status(obj, pod.container, pod.ip, self.network.gateway)
        if pod_status.differs(patch, pod.reported):
            self.api.patch(f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}/status", {"status": patch})
            pod.reported = patch

    def _signal(self, pod: _Pod, grace: float) -> None:
        """SIGTERM to the container's process now (as a runtime stops a container; its PID 1 ignores
        it without a handler); the loop sends SIGKILL once `grace` seconds have passed."""
        pod.term_deadline = time.monotonic() + grace
        with contextlib.suppress(ProcessLookupError):
            os.kill(pod.pid, signal.SIGTERM)

    def _terminate(self, obj: dict[str, Any], pod: _Pod | None) -> None:
        meta = obj["metadata"]
        if pod is not None:
            self._poll(pod)
            if pod.process.poll() is None:
                if pod.term_deadline is None:
                    # As the kubelet: the preStop hook first, then SIGTERM; both within the grace period.
                    grace = float(meta.get("deletionGracePeriodSeconds", pod.plan.grace_seconds))
                    hook = min(pod.plan.pre_stop_sleep_s, grace)
                    if pod.stop_asked is None:
                        pod.stop_asked = time.monotonic()
                        self._event(f"{pod.namespace}/{pod.name}: deleted; preStop sleep {hook:.0f}s, "
                                    f"then SIGTERM; {grace:.0f}s grace")
                    if time.monotonic() - pod.stop_asked >= hook:
                        self._signal(pod, grace - hook)
                return  # _poll sends SIGKILL once the grace period is over
            self._cleanup(pod)
        self._waiting.pop(meta["uid"], None)
        # The kubelet ends a graceful deletion once the containers are gone.
        self.api.delete(
            f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
            {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}},
        )

    def _cleanup(self, pod: _Pod) -> None:
        pod.prober.stop()
        if pod.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pod.process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                pod.process.wait(timeout=10)
        with contextlib.suppress(OSError):
            pod.log.close()
        self.network.remove(pod.netns, pod.ip)
        self._pods.pop(pod.uid, None)


def container_pid(process: subprocess.Popen[bytes], launched: Path | None, timeout: float = 10.0) -> int:
    """The container's pid: the child of `process` (pod_launcher), PID 1 of the pod's PID namespace;
    beside a "pause" (`launched`: the file it writes once the container runs) that one's child.
    `process` itself if it exited first."""
    deadline = time.monotonic() + timeout
    pid, depth = process.pid, 1
    while time.monotonic() < deadline and process.poll() is None:
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            children = []
        # The "pause" shell's only child is the container once it wrote `launched` (before,
        # it may be one of the mount commands).
        if children and (depth == 1 or (launched is not None and launched.exists())):
            pid, depth = int(children[0]), depth + 1
            if depth > (2 if launched else 1):
                return pid
        else:
            time.sleep(0.01)
    return pid
