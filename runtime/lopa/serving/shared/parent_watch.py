"""Children of `lopa serve` die with it, even when it is SIGKILLed (it cannot clean up then).

The launcher keeps the write end of a pipe that its children never inherit, and hands each child
the read end. A child watches it: end of file means the launcher is gone (the kernel closed its
descriptors however it died), and the child removes the launcher's temporary folder, then stops
as on SIGTERM (a worker at once, a master after its orderly shutdown). Unlike a parent-death
signal this does not depend on which thread started the child, and works on every POSIX system.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading

PARENT_FD = "LOPA_PARENT_FD"  # the read end of the launcher's pipe, in a child's environment
CLEANUP_DIR = "LOPA_CLEANUP_DIR"  # a folder the launcher would have removed


class Lifeline:
    """The launcher's side: the pipe, and what a child needs to watch it."""

    def __init__(self, cleanup_dir: str | None = None) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_inheritable(self.read_fd, True)
        self.cleanup_dir = cleanup_dir

    def child_env(self, env: dict[str, str]) -> dict[str, str]:
        env = dict(env, **{PARENT_FD: str(self.read_fd)})
        if self.cleanup_dir:
            env[CLEANUP_DIR] = self.cleanup_dir
        return env

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def watch_parent() -> None:
    """In a child: when the launcher's pipe reaches end of file, clean up and stop (no-op when the
    process was not started by a launcher)."""
    fd = os.environ.pop(PARENT_FD, None)  # popped: a process this one starts has no such pipe
    cleanup = os.environ.pop(CLEANUP_DIR, None)
    if not fd or not fd.isdigit():
        return

    def wait() -> None:
        try:
            while os.read(int(fd), 1):
                pass  # the launcher never writes; anything read is ignored
        except OSError:
            pass
        if cleanup:
            shutil.rmtree(cleanup, ignore_errors=True)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait, name="parent-watch", daemon=True).start()
