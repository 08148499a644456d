"""Group failure policy, as a pure function of what exists and what status remembers.

A collective cannot heal a lost member: when a worker of a formed group is deleted, replaced
(new UID), restarted (restartCount grew) or failed, every worker pod is deleted so the
StatefulSet recreates the whole group. Consecutive restarts are bounded (then Degraded) and
spaced by an exponential backoff; the count is cleared only once the group has been Available
(every worker joined, master serving) without a break for resetAfterSeconds. Pods running an
outdated config hash are rolled (deleted) without counting as failures.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from . import names

Pod = dict[str, Any]


class GroupState(StrEnum):
    """What decide() found a group to be in."""

    FORMING = "Forming"  # waiting for every worker pod to run
    FORMED = "Formed"  # its incarnation is remembered; any change to it is a failure
    ROLLING = "Rolling"  # pods on an outdated config hash are being replaced (no failure)
    RESTARTING = "Restarting"  # a member failed: every worker pod is being recreated
    BACKOFF = "Backoff"  # a member failed: waiting before the next restart
    EXHAUSTED = "Exhausted"  # failurePolicy.maxGroupRestarts reached: left as it is (Degraded)


@dataclass(frozen=True)
class Memory:
    """A group's state kept in status.groups[] between reconciles (status is the operator's only
    memory)."""

    members: tuple[tuple[str, str, int], ...] = ()  # (pod name, uid, restarts) of the formed group
    total_restarts: int = 0
    recent_restarts: int = 0
    last_restart: dt.datetime | None = None
    formed_at: dt.datetime | None = None
    # Since when the group has been Available without a break; None while it is not. Written by
    # status.py (from the group's pods), read here.
    available_since: dt.datetime | None = None

    @classmethod
    def from_status(cls, entry: dict[str, Any]) -> Memory:
        """From the group's entry of status.groups[] (empty for a new group)."""
        return cls(
            members=tuple(
                (m["name"], m["uid"], int(m.get("restarts", 0))) for m in entry.get("members") or []
            ),
            total_restarts=int(entry.get("restarts") or 0),
            recent_restarts=int(entry.get("recentRestarts") or 0),
            last_restart=parse_time(entry.get("lastRestartTime")),
            formed_at=parse_time(entry.get("formedTime")),
            available_since=parse_time(entry.get("availableSince")),
        )

    def to_status(self) -> dict[str, Any]:
        out = {
            "members": [{"name": n, "uid": u, "restarts": r} for n, u, r in self.members],
            "restarts": self.total_restarts,
            "recentRestarts": self.recent_restarts,
            "lastRestartTime": format_time(self.last_restart),
            "formedTime": format_time(self.formed_at),
        }
        return {k: v for k, v in out.items() if v is not None}  # a list entry is replaced whole


@dataclass(frozen=True)
class Decision:
    memory: Memory
    delete: list[Pod] = field(default_factory=list)  # worker pods to delete now
    state: GroupState = GroupState.FORMING
    message: str = ""
    counted: bool = False  # a group restart was started by this decision


def parse_time(value: str | None) -> dt.datetime | None:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


def format_time(value: dt.datetime | None) -> str | None:
    return value.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if value else None


def restarts(pod: Pod) -> int:
    return sum(
        int(c.get("restartCount", 0)) for c in (pod.get("status") or {}).get("containerStatuses") or []
    )


def is_terminating(pod: Pod) -> bool:
    return bool(pod["metadata"].get("deletionTimestamp"))


def config_hash(pod: Pod) -> str | None:
    return (pod["metadata"].get("annotations") or {}).get(names.CONFIG_HASH_ANNOTATION)


def secret_hash(pod: Pod) -> str | None:
    return (pod["metadata"].get("annotations") or {}).get(names.SECRET_HASH_ANNOTATION)


def backoff_seconds(policy: dict[str, Any], recent: int) -> float:
    """Wait before restart number recent+1: none for the first, then backoff * 2^(recent-1), capped."""
    if recent == 0:
        return 0.0
    return float(min(policy["backoffSeconds"] * 2 ** (recent - 1), policy["maxBackoffSeconds"]))


def exit_reason(pod: Pod) -> str:
    """' (OOMKilled, exit code 137)' from the last container termination the kubelet reported, with
    the last line of its termination message when it left one (' (Error, exit code 1: lopa worker:
    error: ...)'; pods.TERMINATION_MESSAGE)."""
    for c in (pod.get("status") or {}).get("containerStatuses") or []:
        for state in (c.get("state") or {}, c.get("lastState") or {}):
            ended = state.get("terminated")
            if ended:
                return exit_reason_of(ended)
    return ""


def exit_reason_of(ended: dict[str, Any]) -> str:
    """' (Error, exit code 1: <the last line of its termination message>)' of one terminated state."""
    reason = ended.get("reason") or "Terminated"
    lines = [line.strip() for line in (ended.get("message") or "").splitlines() if line.strip()]
    said = f": {_clip(lines[-1])}" if lines else ""
    return f" ({reason}, exit code {ended.get('exitCode', '?')}{said})"


def _clip(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _failure(memory: Memory, live: dict[str, Pod]) -> str | None:
    for name, uid, count in memory.members:
        pod = live.get(name)
        if pod is None:
            return f"worker pod {name} was lost"
        if pod["metadata"]["uid"] != uid:
            return f"worker pod {name} was replaced"
        if restarts(pod) > count:
            return f"worker pod {name} restarted{exit_reason(pod)}"
        if (pod.get("status") or {}).get("phase") == "Failed":
            return f"worker pod {name} failed{exit_reason(pod)}"
    return None


def decide(
    workers: list[Pod],
    wanted: int,
    desired_hash: str,
    memory: Memory,
    policy: dict[str, Any],
    now: dt.datetime,
    desired_secret: str | None = None,
) -> Decision:
    """`desired_secret`: the hash of the group Secret's data the pods must run with (None: not
    checked, for a group the rollout holds)."""
    live = {p["metadata"]["name"]: p for p in workers if not is_terminating(p)}
    rolling = _rolling(live, desired_hash, desired_secret, memory)
    if rolling is not None:
        return rolling
    if memory.members:
        return _watch_formed(live, wanted, memory, policy, now)
    running = [p for p in live.values() if (p.get("status") or {}).get("phase") == "Running"]
    if len(live) == wanted and len(running) == wanted:
        # Remember the incarnation that forms the group: any change to it later is a failure.
        members = tuple(sorted((p["metadata"]["name"], p["metadata"]["uid"], restarts(p)) for p in running))
        return Decision(
            replace(memory, members=members, formed_at=now), state=GroupState.FORMED, message="group formed"
        )
    return Decision(
        memory, state=GroupState.FORMING, message=f"{len(running)}/{wanted} worker pod(s) running"
    )


def _rolling(
    live: dict[str, Pod], desired_hash: str, desired_secret: str | None, memory: Memory
) -> Decision | None:
    """The pods to roll when some run another config or another group Secret (no failure)."""
    stale = [p for p in live.values() if config_hash(p) != desired_hash]
    if stale:
        # A spec change: every pod must run the new config; this is no failure.
        return Decision(
            replace(memory, members=(), formed_at=None, recent_restarts=0),
            delete=stale,
            state=GroupState.ROLLING,
            message=f"rolling {len(stale)} worker pod(s) to config {desired_hash}",
        )
    old_secret = [p for p in live.values() if desired_secret is not None and secret_hash(p) != desired_secret]
    if old_secret:
        # The group Secret was made again (deleted by hand, say): a group never runs two secrets.
        # No failure either; the master's Deployment rolls by itself (its template changed too).
        return Decision(
            replace(memory, members=(), formed_at=None),
            delete=old_secret,
            state=GroupState.ROLLING,
            message=f"rolling {len(old_secret)} worker pod(s) onto the group's new Secret",
        )
    return None


def _watch_formed(
    live: dict[str, Pod], wanted: int, memory: Memory, policy: dict[str, Any], now: dt.datetime
) -> Decision:
    """A formed group: kept while its incarnation is intact, else restarted (after a backoff, up to
    failurePolicy.maxGroupRestarts in a row)."""
    failure = _failure(memory, live)
    if failure is None:
        # Only a group that served (Available) for the whole window clears the count: one
        # whose pods all run but that never becomes Available (a rank that cannot join)
        # keeps counting toward maxGroupRestarts.
        if (
            memory.recent_restarts
            and memory.available_since
            and ((now - memory.available_since).total_seconds() >= policy["resetAfterSeconds"])
        ):
            memory = replace(memory, recent_restarts=0)
        return Decision(
            memory, state=GroupState.FORMED, message=f"{len(memory.members)} worker pod(s) in the group"
        )
    if memory.recent_restarts >= policy["maxGroupRestarts"]:
        return Decision(
            memory,
            state=GroupState.EXHAUSTED,
            message=f"{failure}; {memory.recent_restarts} consecutive group restart(s) reached "
            f"failurePolicy.maxGroupRestarts={policy['maxGroupRestarts']}",
        )
    wait = backoff_seconds(policy, memory.recent_restarts)
    if memory.last_restart and (now - memory.last_restart).total_seconds() < wait:
        return Decision(
            memory,
            state=GroupState.BACKOFF,
            message=f"{failure}; restarting the group after {wait:.0f}s backoff",
        )
    memory = replace(
        memory,
        members=(),
        formed_at=None,
        total_restarts=memory.total_restarts + 1,
        recent_restarts=memory.recent_restarts + 1,
        last_restart=now,
    )
    return Decision(
        memory,
        delete=list(live.values()),
        state=GroupState.RESTARTING,
        message=f"{failure}; recreating all {wanted} worker pod(s) "
        f"(restart {memory.recent_restarts}/{policy['maxGroupRestarts']})",
        counted=True,
    )
