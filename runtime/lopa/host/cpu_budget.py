"""How many CPU threads torch may run: the cores this process can use, container limits included.

torch sizes its intra-op pool from the cores it sees, and a container's CPU limit (a Kubernetes
`resources.limits.cpu`, `docker run --cpus`) is not something it sees: the limit is a CFS bandwidth
quota, and the affinity mask still holds every core of the node. A worker with a 4-core limit on a
64-core node would run 32 threads in lockstep against 4 cores of quota and spend most periods
throttled. `fit_torch_threads` caps torch at the quota (rounded down: one thread over the quota is
enough to get the lockstep group throttled) unless OMP_NUM_THREADS says otherwise.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

log = logging.getLogger("lopa.execution")

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _own_paths(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """This process's cgroup path in the unified (v2) hierarchy and in v1's cpu controller."""
    unified = cpu = None
    for line in (_read(proc_cgroup) or "").splitlines():
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            unified = path
        elif "cpu" in controllers.split(","):
            cpu = path
    return unified, cpu


def _candidates(own: str | None, base: Path) -> list[Path]:
    """The process's own cgroup directory first, then the root of the mount (what a container with
    its own cgroup namespace sees)."""
    paths = [base / own.lstrip("/")] if own and own != "/" else []
    return [*paths, base]


def cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """Cores the cgroup CPU quota allows (fractional), or None when no quota is set or readable."""
    try:
        return _quota(root, proc_cgroup)
    except (ValueError, ZeroDivisionError):  # a file this code does not understand: torch's own count
        log.warning("unreadable cgroup CPU quota under %s: torch keeps its thread count", root)
        return None


def _quota(root: Path, proc_cgroup: Path) -> float | None:
    unified, cpu = _own_paths(proc_cgroup)
    for directory in _candidates(unified, root):
        text = _read(directory / "cpu.max")  # cgroup v2: "<quota> <period>" or "max <period>"
        if text is not None:
            quota, _, period = text.partition(" ")
            return None if quota == "max" else int(quota) / int(period)
    for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        for directory in _candidates(cpu, root / mount):
            quota_us = _read(directory / "cpu.cfs_quota_us")
            period_us = _read(directory / "cpu.cfs_period_us")
            if quota_us is not None and period_us is not None:
                return None if int(quota_us) < 0 else int(quota_us) / int(period_us)
    return None


def usable_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """The cores this process may keep busy: its affinity mask, capped by the quota (floor, >= 1)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cpu_quota(root, proc_cgroup)
    if quota is not None:
        cores = min(cores, math.floor(quota))
    return max(1, cores)


def fit_torch_threads(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int | None:
    """Lower torch's intra-op threads to the usable cores when a quota binds below them; the new
    count, or None when nothing changed (OMP_NUM_THREADS set, no quota, or already within it)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    import torch

    threads, usable = torch.get_num_threads(), usable_cpus(root, proc_cgroup)
    if usable >= threads:
        return None
    torch.set_num_threads(usable)
    log.info("torch threads %d -> %d: the cgroup CPU quota allows %d core(s) (OMP_NUM_THREADS overrides)",
             threads, usable, usable)
    return usable
