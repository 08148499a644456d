"""The clients' venvs: built and located by tools/bench-clients/setup.sh (outside lopa's .venv)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

CLIENTS = ("inference-perf", "guidellm")
NO_PYTHON = 3  # setup.sh's exit status when no Python >= 3.12 is found or installable
SETUP_ENV = "LOPA_BENCH_CLIENTS_SETUP"  # another setup script (default: the repository's)


class ToolchainError(RuntimeError):
    """A client venv could not be built or found."""


class NoPython(ToolchainError):
    """No Python >= 3.12 on this machine, and none could be installed."""


def setup_script() -> Path:
    """tools/bench-clients/setup.sh of the repository this package runs from (an editable install),
    or the script named by LOPA_BENCH_CLIENTS_SETUP."""
    named = os.environ.get(SETUP_ENV)
    repository = Path(__file__).resolve().parents[3]
    script = Path(named) if named else repository / "tools" / "bench-clients" / "setup.sh"
    if not script.is_file():
        raise ToolchainError(f"no {script}: run from a lopa checkout (pip install -e runtime) "
                             f"or set {SETUP_ENV}")
    return script


def venvs(clients: tuple[str, ...], build: bool = True) -> dict[str, Path]:
    """Each client's venv directory; with `build`, builds the missing ones first (minutes the first
    time; the script's progress goes to this process's stderr)."""
    unknown = sorted(set(clients) - set(CLIENTS))
    if unknown:
        raise ToolchainError(f"unknown client {unknown[0]!r}; known: {', '.join(CLIENTS)}")
    args = [str(setup_script()), *([] if build else ["--print-dir"]), *clients]
    # stderr inherited: the build's progress reaches the terminal (or whatever captures fd 2).
    done = subprocess.run(args, stdout=subprocess.PIPE, stderr=None, text=True, check=False)
    if done.returncode == NO_PYTHON:
        raise NoPython("no Python >= 3.12 found or installable (set LOPA_BENCH_PYTHON to one)")
    if done.returncode != 0:
        raise ToolchainError(f"{args[0]} exited with status {done.returncode} (its log is above)")
    dirs = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    missing = [c for c in clients if c not in dirs]
    if missing:
        raise ToolchainError(f"{args[0]} printed no venv for {', '.join(missing)}")
    found = {client: Path(dirs[client]) for client in clients}
    unbuilt = [c for c, d in found.items() if not (d / ".complete").exists()]
    if unbuilt:
        raise ToolchainError(f"not built: {', '.join(unbuilt)} (run {args[0]} {' '.join(unbuilt)})")
    return found
