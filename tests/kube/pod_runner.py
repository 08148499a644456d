"""Runs, as local processes, the pods the scheduler binds to one node of the test cluster.

`PodRunner(kube).start()` registers a Node that kwok does not manage (`process_node`), a pod network
(`netns`), a cluster DNS (`cluster_dns`) and a Service proxy (`service_proxy`), then a loop plays
the kubelet of that node, every `TICK_SECONDS`:
- a new pod bound to the node gets its own network namespace and address, its containers are
  planned from the Pod object (`pod_plan`: argv, env, volumes) and started as processes in its
  sandbox (`pod_sandbox`: the namespaces, mounts, /etc/hosts and resolv.conf): its init containers
  one after the other, each to completion, then its container, which is probed (`prober`); a pod
  whose ConfigMap, Secret or claim is missing (or unbound) waits, as with a kubelet;
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
watched; exited containers are not restarted, a failed init container neither (`pod_status`);
images, resources, startupProbe, sidecar containers, several containers per pod and preStop hooks
other than sleep are not supported; it runs as the cluster admin.
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
from .container_process import container_pid, launch, log_name
from .errors import KubeClusterError
from .kube_api import Api, ApiError
from .prober import Prober
from .processes import tail
from .service_proxy import ServiceProxy

__all__ = ["NODE_NAME", "PodRunner", "container_pid"]

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
    pod_dir: Path
    read_only: set[str]
    # What runs now: an init container's process, then the container's.
    process: subprocess.Popen[bytes]
    log: IO[bytes]
    log_path: Path
    pid: int  # the container's process (PID 1 of its PID namespace, or a child of a "pause")
    init: list[pod_status.ContainerState]  # the init containers started so far, in order
    container: pod_status.ContainerState | None = None  # once every init container completed
    prober: Prober | None = None
    init_failed: bool = False
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
            running = pod.container is not None and pod.process.poll() is None
            if (pod.namespace, pod.name) == (namespace, name) and running:
                return pod.pid
        return None

    def kill(self, namespace: str, name: str, sig: int = signal.SIGKILL) -> int:
        """Signals pod `name`'s container process (as if it crashed); returns its pid."""
        pid = self.pid(namespace, name)
        if pid is None:
            raise KubeClusterError(f"pod {namespace}/{name} has no running process")
        os.kill(pid, sig)
        return pid

    def log(self, namespace: str, name: str, lines: int = 60, init: str = "") -> str:
        """The last lines of the output of pod `name`'s latest container (or init container `init`)."""
        path = self._logs.get((namespace, f"{name}:{init}" if init else name))
        return tail(path, lines) if path else f"(pod {namespace}/{name} {init} never ran here)"

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
                if pod.container is None:
                    self._poll_init(obj, pod)
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
                pod_sandbox.read_only_volumes(obj), plan.init_containers[0] if plan.init_containers else None,
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
        first = plan.init_containers[0] if plan.init_containers else None
        launched = launch(argv, first.env if first else plan.env, pod_dir / log_name(first),
                           plan.share_pid and first is None)
        pod = _Pod(meta["namespace"], meta["name"], uid, name, address, plan, pod_dir,
                   pod_sandbox.read_only_volumes(obj), *launched, init=[])
        self._pods[uid] = pod
        self._started(obj, pod)
        self._report(obj, pod)

    def _started(self, obj: dict[str, Any], pod: _Pod) -> None:
        """Records what _launch started for `pod`: its next init container, else its container."""
        where = f"{pod.namespace}/{pod.name}"
        step = len(pod.init)
        if step < len(pod.plan.init_containers):
            spec = pod.plan.init_containers[step]
            image = obj["spec"]["initContainers"][step].get("image", "")
            state = pod_status.ContainerState(spec.name, f"process://{pod.pid}", image, pod_status.now())
            pod.init.append(state)
            self._logs[(pod.namespace, f"{pod.name}:{spec.name}")] = pod.log_path
            self._event(f"{where}: init container {spec.name} started pid {pod.pid} at {pod.ip}: "
                        f"{' '.join(spec.argv)}")
            return
        image = obj["spec"]["containers"][0].get("image", "")
        pod.container = pod_status.ContainerState(pod.plan.container, f"process://{pod.pid}", image,
                                                  pod_status.now())
        pod.prober = Prober(pod.plan, pod.ip, pod.pid, self._probe_event(where))
        self._logs[(pod.namespace, pod.name)] = pod.log_path
        self._event(f"{where}: started pid {pod.pid} at {pod.ip}: {' '.join(pod.plan.argv)}")

    def _poll_init(self, obj: dict[str, Any], pod: _Pod) -> None:
        """An init container that exited: the next one (or the container) starts after a success; a
        failure leaves the pod Pending, the init container's status saying why."""
        code = pod.process.poll()
        if pod.init_failed or code is None:
            return
        state, spec = pod.init[-1], pod.plan.init_containers[len(pod.init) - 1]
        state.exit_code = code if code >= 0 else 128 - code
        state.finished_at = pod_status.now()
        pod.log.close()
        where = f"{pod.namespace}/{pod.name}"
        if state.exit_code != 0:
            pod.init_failed = True
            if spec.fallback_to_logs:  # the kubelet's rule: the log's last 80 lines, at most 2048 bytes
                state.message = tail(pod.log_path, 80)[-2048:]
            self._event(f"{where}: init container {spec.name} exited {state.exit_code}; the pod stays "
                        "Pending")
            return
        self._event(f"{where}: init container {spec.name} completed")
        rest = pod.plan.init_containers[len(pod.init):]
        nxt = rest[0] if rest else None
        try:
            argv = pod_sandbox.prepare(pod.plan, pod.pod_dir, self.network.netns_path(pod.netns), pod.ip,
                                       self.network.gateway, pod.read_only, nxt)
        except pod_plan.Unsupported as error:
            pod.init_failed = True
            self._refuse(obj, str(error))
            return
        env = nxt.env if nxt else pod.plan.env
        share_pid = pod.plan.share_pid and nxt is None
        log_path = pod.pod_dir / log_name(nxt)
        pod.process, pod.log, pod.log_path, pod.pid = launch(argv, env, log_path, share_pid)
        self._started(obj, pod)

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
        assert pod.prober is not None and pod.container is not None
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
        if pod.container is None:
            patch = pod_status.initializing(obj, pod.ip, self.network.gateway, pod.init)
        else:
            patch = pod_status.status(obj, pod.container, pod.ip, self.network.gateway, pod.init)
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
            if pod.container is None:
                self._poll_init(obj, pod)
            else:
                self._poll(pod)
            if pod.process.poll() is None:
                if pod.term_deadline is None:
                    # As the kubelet: the preStop hook first, then SIGTERM; both within the grace period.
                    # (An init container has no preStop hook.)
                    grace = float(meta.get("deletionGracePeriodSeconds", pod.plan.grace_seconds))
                    hook = min(pod.plan.pre_stop_sleep_s if pod.container else 0.0, grace)
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
        if pod.prober is not None:
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
