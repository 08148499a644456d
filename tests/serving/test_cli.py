"""`lopa serve --workers 2 --prompt ...`: launcher, master, workers and client end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from lopa.serving.launcher import free_ports

from .conftest import worker_env


def test_serve_one_shot(checkpoint: Path) -> None:
    port = free_ports(1)[0]
    command = [
        sys.executable, "-m", "lopa", "serve", "--workers", "2", "--model", str(checkpoint),
        "--block-size", "8", "--max-new-tokens", "16", "--branches", "2",
        "--listen", f"127.0.0.1:{port}", "--prompt", "12+34=", "--start-timeout", "120",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=worker_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tokens in" in done.stderr and "over 2 workers" in done.stderr


def test_serve_without_a_model_fails_fast(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "lopa", "serve", "--workers", "2", "--model", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=worker_env())
    assert done.returncode == 1 and "has no config.json" in done.stderr
