"""A container of a process-node pod as one local process: starting it and finding its pid."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import IO

from . import pod_plan, pod_sandbox
from .processes import die_with_parent


def log_name(init: pod_plan.InitPlan | None) -> str:
    """The log file of a pod's container, or of its init container `init`."""
    return f"init-{init.name}.log" if init else "container.log"


def launch(
    argv: list[str], env: dict[str, str], log_path: Path, share_pid: bool
) -> tuple[subprocess.Popen[bytes], IO[bytes], Path, int]:
    """Starts one container's process (argv from pod_sandbox.prepare): (process, log, log path, pid)."""
    log = log_path.open("ab")
    process = subprocess.Popen(
        argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd="/",
        start_new_session=True,  # its own process group, like a container's processes
        preexec_fn=die_with_parent,  # dies with the test process, however it dies
    )
    pid = container_pid(process, log_path.parent / pod_sandbox.LAUNCHED if share_pid else None)
    return process, log, log_path, pid


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
