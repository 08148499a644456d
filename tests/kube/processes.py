"""Running the control plane's component processes: ports, spawning, supervision, stopping.

Every child runs in its own process group with its output in a log file, and gets
SIGKILL when the Python process dies (PR_SET_PDEATHSIG), however it dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from .errors import KubeClusterError

WORK_DIR_PREFIX = "lopa-kube-"
OWNER_FILE = "owner.pid"


def remove_stale_work_dirs() -> None:
    """Removes work dirs left by test runs that were killed (their owner pid is gone);
    their processes already died with them (PR_SET_PDEATHSIG), only files remain."""
    for path in Path(tempfile.gettempdir()).glob(f"{WORK_DIR_PREFIX}*"):
        try:
            owner = int((path / OWNER_FILE).read_text())
            os.kill(owner, 0)
        except ProcessLookupError:
            if not (path / "keep").exists():
                shutil.rmtree(path, ignore_errors=True)
        except (OSError, ValueError):
            continue  # no owner file (kept on purpose, or being created) or not ours to judge


# Loaded here, in the parent: a forked child of this multithreaded process must not dlopen (the
# loader's lock may be held by another thread at the fork, and the child then crashes or hangs).
try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL("libc.so.6", use_errno=True)
    _PRCTL = _LIBC.prctl
except OSError:
    _LIBC = _PRCTL = None
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when the Python process dies, however it dies."""
    if _PRCTL is not None:
        with contextlib.suppress(Exception):
            _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


def tail(path: Path, lines: int = 40) -> str:
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 64 * 1024))
            text = handle.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class Component:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]


def spawn(name: str, executable: Path, args: list[str], log_path: Path, work_dir: Path) -> Component:
    """Starts `executable` in `work_dir` (HOME=work_dir/home), its output appended to `log_path`."""
    binary = executable.name
    log_file = log_path.open("ab")
    log_file.write(f"$ {binary} {' '.join(args)}\n".encode())
    log_file.flush()
    process = subprocess.Popen(
        [str(executable), *args],
        stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
        cwd=work_dir, env={**os.environ, "HOME": str(work_dir / "home")},
        start_new_session=True,  # own process group: stop() signals it and its children
        preexec_fn=die_with_parent,  # only calls prctl, safe between fork and exec
    )
    return Component(name, process, log_path, log_file)


def check_alive(components: Sequence[Component], description: str) -> None:
    """Raises KubeClusterError if any component has exited (while waiting for `description`)."""
    for component in components:
        code = component.process.poll()
        if code is not None:
            raise KubeClusterError(
                f"{component.name} exited with code {code} while waiting for {description}"
            )


def stop_components(components: Sequence[Component], timeout: float) -> None:
    """Stops every component (newest first), killing any that is slow to stop."""
    # One at a time, clients before servers: stopping etcd under a live API server
    # would make the API server's graceful shutdown hang on its storage until killed.
    # The data is thrown away, so a component slow to stop is simply killed.
    per_component = max(1.0, timeout / max(1, len(components)))
    for component in reversed(components):
        if component.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(component.process.pid, signal.SIGTERM)
            try:
                component.process.wait(timeout=per_component)
            except subprocess.TimeoutExpired:
                # Still alive (not yet reaped), so its process group id is still its own.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(component.process.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    component.process.wait(timeout=10)
        component.log_file.close()
