"""The kubelet's readiness and liveness probes, run against a pod's process from the host.

One thread per pod runs each probe of its container on the kubelet's schedule: the first after
initialDelaySeconds, then every periodSeconds, each bounded by timeoutSeconds; a result flips
after successThreshold consecutive successes or failureThreshold consecutive failures. Readiness
starts false (true at once when the container has no readinessProbe); a liveness failure is
reported so that the runner stops the container. Handlers:
- grpc: `grpc.health.v1.Health/Check` of probe.grpc.service (default "") at podIP:port, plaintext,
  success when SERVING;
- tcpSocket: a TCP connect to podIP:port (a named port is the container's port of that name);
- httpGet: GET http://podIP:port/path (scheme HTTP only), success for a status in [200, 400);
- exec: the command in the container's network, mount and UTS namespaces (nsenter into its
  process) with the container's env, success for exit code 0.

Where it differs from a kubelet: probes come from the host over the pod network rather than from
the node's own network stack; startupProbe is not supported (the runner refuses such pods).
"""

from __future__ import annotations

import socket
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .pod_plan import PodPlan, Unsupported


@dataclass
class ProbeState:
    ready: bool = False
    live: bool = True
    last_error: str = ""


def check(probe: dict[str, Any], plan: PodPlan, pod_ip: str, pid: int) -> tuple[bool, str]:
    """Runs one probe once: (success, what failed)."""
    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        if "grpc" in probe:
            target = f"{pod_ip}:{plan.port(probe['grpc']['port'])}"
            with grpc.insecure_channel(target) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", "")), timeout=timeout
                )
            serving = health_pb2.HealthCheckResponse
            ok = reply.status == serving.SERVING
            return ok, "" if ok else f"grpc health {serving.ServingStatus.Name(reply.status)}"
        if "tcpSocket" in probe:
            with socket.create_connection((pod_ip, plan.port(probe["tcpSocket"]["port"])), timeout=timeout):
                return True, ""
        if "httpGet" in probe:
            http = probe["httpGet"]
            url = f"http://{pod_ip}:{plan.port(http['port'])}{http.get('path', '/')}"
            headers = {h["name"]: h["value"] for h in http.get("httpHeaders") or []}
            request = urllib.request.Request(url, headers=headers)
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                return 200 <= reply.status < 400, f"HTTP {reply.status}"
        if "exec" in probe:
            nsenter = ["nsenter", "-t", str(pid), "--net", "--mount", "--uts", "--"]
            result = subprocess.run(
                [*nsenter, *probe["exec"]["command"]], env=plan.env, capture_output=True, timeout=timeout,
                check=False,
            )
            return result.returncode == 0, f"exit {result.returncode}: {result.stdout[-200:]!r}"
    except grpc.RpcError as error:
        return False, f"grpc {error.code().name}"  # type: ignore[attr-defined]
    except (OSError, urllib.error.URLError, subprocess.TimeoutExpired) as error:
        return False, repr(error)
    raise Unsupported(f"probe {sorted(probe)} is not supported")


class Prober:
    """Probes one running container until `stop()`; `state` is read by the runner."""

    def __init__(
        self, plan: PodPlan, pod_ip: str, pid: int, on_change: Callable[[str, bool, str], None] | None = None
    ) -> None:
        self.plan, self.pod_ip, self.pid = plan, pod_ip, pid
        self.state = ProbeState(ready=plan.readiness is None)
        self._on_change = on_change or (lambda kind, value, why: None)  # (probe kind, new result, why)
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(kind, probe), name=f"probe-{kind}", daemon=True)
            for kind, probe in (("readiness", plan.readiness), ("liveness", plan.liveness))
            if probe
        ]
        for thread in self._threads:
            thread.start()

    def _loop(self, kind: str, probe: dict[str, Any]) -> None:
        period = float(probe.get("periodSeconds", 10))
        successes = int(probe.get("successThreshold", 1))
        failures = int(probe.get("failureThreshold", 3))
        run = fail = 0
        if self._stop.wait(float(probe.get("initialDelaySeconds", 0))):
            return
        while not self._stop.is_set():
            ok, why = check(probe, self.plan, self.pod_ip, self.pid)
            run, fail = (run + 1, 0) if ok else (0, fail + 1)
            if not ok:
                self.state.last_error = f"{kind} probe failed: {why}"
            changed = False
            if kind == "readiness":
                if ok and run >= successes and not self.state.ready:
                    self.state.ready, changed = True, True
                elif not ok and fail >= failures and self.state.ready:
                    self.state.ready, changed = False, True
            elif not ok and fail >= failures and self.state.live:
                self.state.live, changed = False, True
            if changed:
                self._on_change(kind, ok, why)
            self._stop.wait(period)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
