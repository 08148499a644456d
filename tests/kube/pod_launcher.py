"""Starts a pod's container as PID 1 of new mount, UTS and PID namespaces; exits as it exits.

Usage (in the pod's network namespace): `python -I -S pod_launcher.py SCRIPT ARG...`. The launcher
makes the namespaces, forks, and the child (PID 1 of the new PID namespace, /proc remounted for it)
execs `sh SCRIPT ARG...` (`pod_sandbox`'s script: mounts, hostname, then the container). The
launcher waits for it and ends with its status: its exit code, or the same signal that killed it,
so the harness reads the container's status from the launcher's. `unshare --fork` would do the
same, but util-linux 2.38 exits 1 instead of re-raising its child's signal.

Standalone on purpose (no imports from the harness): it runs with the pod's environment.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWPID = 0x00020000, 0x04000000, 0x20000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000
PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            raise OSError(ctypes.get_errno(), f"pod_launcher: {what}: {os.strerror(ctypes.get_errno())}")

    check(libc.unshare(CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWPID), "unshare")
    # Nothing the pod mounts may propagate back to the host's mount namespace.
    check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    # A SIGTERM for the pod goes to its container, not to this waiter.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    child = os.fork()
    if child == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL), "prctl")  # the namespace dies with us
        check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), "mount /proc")
        os.execv("/bin/sh", ["sh", *argv])
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)  # end as the container ended: killed by that signal
    return os.waitstatus_to_exitcode(status) if not os.WIFSIGNALED(status) else 128 + os.WTERMSIG(status)



if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
