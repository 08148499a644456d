"""The control plane's binaries, built by `tools/k8s-testenv/build.sh`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import TextIO

from .errors import KubeClusterError

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "tools" / "k8s-testenv" / "build.sh"
REQUIRED_BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kwok",
    "helm",
)
# kwok's default stages (node init/heartbeat, pod ready/complete/delete), which build.sh
# extracts from the pinned kwok module next to the binaries.
KWOK_STAGES = "kwok-stages.yaml"


def find_bin_dir(env_var: str = "LOPA_TESTENV_BIN_DIR") -> Path:
    """The directory the binaries are (or would be) in, as build.sh computes it.

    `LOPA_TESTENV_BIN_DIR` overrides it (e.g. to use binaries built elsewhere).
    """
    override = os.environ.get(env_var)
    if override:
        return Path(override)
    result = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--print-bin-dir"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    if result.returncode != 0:
        raise KubeClusterError(f"{BUILD_SCRIPT} --print-bin-dir failed:\n{result.stderr}")
    return Path(result.stdout.strip().splitlines()[-1])


def missing_binaries(bin_dir: Path) -> list[str]:
    missing = [name for name in REQUIRED_BINARIES if not os.access(bin_dir / name, os.X_OK)]
    if not (bin_dir / KWOK_STAGES).is_file():
        missing.append(KWOK_STAGES)
    return missing


def ensure_binaries(progress: TextIO | None = None) -> Path:
    """Returns the bin dir, running build.sh first when a binary is missing.

    A cold build compiles Kubernetes from source (tens of minutes on 2 cores); its
    progress lines are copied to `progress` (default: stderr) as they come.
    """
    bin_dir = find_bin_dir()
    if not missing_binaries(bin_dir):
        return bin_dir
    if os.environ.get("LOPA_TESTENV_BIN_DIR"):
        raise KubeClusterError(
            f"LOPA_TESTENV_BIN_DIR={bin_dir} lacks {', '.join(missing_binaries(bin_dir))}"
        )
    out = progress or sys.stderr
    out.write(f"\n[kube] test control plane binaries missing; running {BUILD_SCRIPT}\n")
    out.flush()
    process = subprocess.Popen(
        ["bash", str(BUILD_SCRIPT)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
    )
    assert process.stdout is not None
    lines: list[str] = []
    for line in process.stdout:
        lines.append(line)
        out.write(line)
        out.flush()
    if process.wait() != 0:
        raise KubeClusterError(f"{BUILD_SCRIPT} failed (exit {process.returncode}):\n{''.join(lines[-40:])}")
    built = Path(lines[-1].strip()) if lines else bin_dir
    if missing_binaries(built):
        raise KubeClusterError(f"{BUILD_SCRIPT} finished but {built} lacks {missing_binaries(built)}")
    return built
