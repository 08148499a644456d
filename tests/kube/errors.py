"""Errors raised by the test control plane helpers."""

from __future__ import annotations

import subprocess


class KubeClusterError(RuntimeError):
    """The test control plane could not be built, started or used."""


class CommandError(KubeClusterError):
    """A kubectl/helm command exited non-zero; carries its output."""

    def __init__(self, result: subprocess.CompletedProcess[str]) -> None:
        self.result = result
        super().__init__(
            f"command {' '.join(map(str, result.args))!r} exited {result.returncode}\n"
            f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
        )
