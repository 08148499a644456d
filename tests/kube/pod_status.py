"""The pod status a kubelet reports, as a pure function of what the runner knows of the process.

`status(...)` is a merge patch of pod.status: phase, podIP(s), hostIP(s), startTime, the
conditions (PodScheduled kept from the scheduler; PodReadyToStartContainers, Initialized,
ContainersReady, Ready), the init containers' statuses and the one container's status (running /
terminated with its exit code, ready, started, restartCount 0). Lists are whole in a merge patch,
so they are sent whole. While an init container runs, or after one failed, the pod is Pending
(Initialized False) and its container waits (PodInitializing).

Where it differs from a kubelet: an exited container is never restarted, whatever the pod's
restartPolicy: exit code 0 makes the pod Succeeded, any other code (or a signal: 128 + signal, as
a runtime reports it) Failed. A failing liveness probe stops the container the same way. The
operator's group policy reads either (a restart or a Failed pod) as a lost worker. A failed init
container is not restarted either: it stays terminated (its termination message the log's tail
under FallbackToLogsOnError) and the pod Pending, where a kubelet would retry it with a backoff.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class ContainerState:
    name: str
    container_id: str
    image: str
    started_at: str
    ready: bool = False
    exit_code: int | None = None  # set once the process has exited
    finished_at: str = ""
    message: str = ""  # why it was stopped (a liveness failure), if the runner stopped it


def _condition(kind: str, ok: bool, since: str, reason: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {"type": kind, "status": "True" if ok else "False", "lastProbeTime": None,
                           "lastTransitionTime": since}
    if reason:
        out["reason"] = reason
    return out


def _state(c: ContainerState, stamp: str) -> dict[str, Any]:
    if c.exit_code is None:
        return {"running": {"startedAt": c.started_at}}
    return {
        "terminated": {
            "exitCode": c.exit_code,
            "reason": "Completed" if c.exit_code == 0 else "Error",
            "startedAt": c.started_at,
            "finishedAt": c.finished_at or stamp,
            "containerID": c.container_id,
            **({"message": c.message} if c.message else {}),
        }
    }


def _init_statuses(pod: dict[str, Any], init: list[ContainerState], stamp: str) -> list[dict[str, Any]]:
    """Every init container of the pod: the ones started so far, then the ones still to run."""
    waiting = {"waiting": {"reason": "PodInitializing"}}
    out = [{"name": c.name, "image": c.image, "imageID": "", "containerID": c.container_id,
            "ready": c.exit_code == 0, "started": c.exit_code is None, "restartCount": 0,
            "state": _state(c, stamp)} for c in init]
    for spec in (pod.get("spec") or {}).get("initContainers", [])[len(init):]:
        out.append({"name": spec["name"], "image": spec.get("image", ""), "imageID": "", "ready": False,
                    "started": False, "restartCount": 0, "state": waiting})
    return out


def initializing(
    pod: dict[str, Any], pod_ip: str, host_ip: str, init: list[ContainerState]
) -> dict[str, Any]:
    """The status while the init containers run, or after one failed: Pending, not initialized."""
    stamp = now()
    old = {c["type"]: c for c in (pod.get("status") or {}).get("conditions") or []}
    conditions = [
        _condition("PodReadyToStartContainers", True, stamp),
        _condition("Initialized", False, stamp, "ContainersNotInitialized"),
        _condition("Ready", False, stamp, "ContainersNotReady"),
        _condition("ContainersReady", False, stamp, "ContainersNotReady"),
    ]
    for cond in conditions:
        before = old.get(cond["type"])
        if before and before.get("status") == cond["status"]:
            cond["lastTransitionTime"] = before.get("lastTransitionTime", stamp)
    if "PodScheduled" in old:
        conditions.append(old["PodScheduled"])
    main = (pod.get("spec") or {})["containers"][0]
    return {
        "phase": "Pending",
        "hostIP": host_ip,
        "hostIPs": [{"ip": host_ip}],
        "podIP": pod_ip,
        "podIPs": [{"ip": pod_ip}],
        "startTime": (pod.get("status") or {}).get("startTime") or (init[0].started_at if init else stamp),
        "conditions": conditions,
        "initContainerStatuses": _init_statuses(pod, init, stamp),
        "containerStatuses": [{"name": main["name"], "image": main.get("image", ""), "imageID": "",
                               "ready": False, "started": False, "restartCount": 0,
                               "state": {"waiting": {"reason": "PodInitializing"}}}],
    }


def status(pod: dict[str, Any], container: ContainerState, pod_ip: str, host_ip: str,
           init: list[ContainerState] | None = None) -> dict[str, Any]:
    """The whole status patch (transition times kept where a condition's value did not change);
    `init`: the init containers, all of which completed."""
    exited = container.exit_code is not None
    phase = "Running" if not exited else ("Succeeded" if container.exit_code == 0 else "Failed")
    ready = container.ready and not exited
    stamp = now()
    old = {c["type"]: c for c in (pod.get("status") or {}).get("conditions") or []}

    def keep(cond: dict[str, Any]) -> dict[str, Any]:
        before = old.get(cond["type"])
        if before and before.get("status") == cond["status"]:
            cond["lastTransitionTime"] = before.get("lastTransitionTime", stamp)
        return cond

    not_ready = "" if ready else ("PodCompleted" if exited else "ContainersNotReady")
    conditions = [
        keep(_condition("PodReadyToStartContainers", not exited, stamp)),
        keep(_condition("Initialized", True, stamp)),
        keep(_condition("Ready", ready, stamp, not_ready)),
        keep(_condition("ContainersReady", ready, stamp, not_ready)),
    ]
    if "PodScheduled" in old:
        conditions.append(old["PodScheduled"])
    state = _state(container, stamp)
    extra = {"initContainerStatuses": _init_statuses(pod, init, stamp)} if init else {}
    return {
        "phase": phase,
        "hostIP": host_ip,
        "hostIPs": [{"ip": host_ip}],
        "podIP": pod_ip,
        "podIPs": [{"ip": pod_ip}],
        "startTime": (pod.get("status") or {}).get("startTime") or container.started_at,
        "conditions": conditions,
        "containerStatuses": [
            {
                "name": container.name,
                "image": container.image,
                "imageID": "",
                "containerID": container.container_id,
                "ready": ready,
                "started": not exited,
                "restartCount": 0,
                "state": state,
            }
        ],
        **extra,
    }


def differs(patch: dict[str, Any], reported: dict[str, Any] | None) -> bool:
    """Whether `patch` says something new compared with the last patch sent (times aside)."""
    if reported is None:
        return True

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in ("lastTransitionTime", "lastProbeTime")}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return bool(strip(patch) != strip(reported))
