"""`lopa serve --workers 2 --prompt ...`: launcher, master, workers and client end to end."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from lopa.serving.launcher import free_ports

from .conftest import worker_env, write_config


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


def test_master_stops_cleanly_on_sigterm(tmp_path: Path, checkpoint: Path) -> None:
    """Kubernetes stops a pod with SIGTERM: exit 0, promptly, with no traceback (no workers needed)."""
    config = write_config(tmp_path, checkpoint, workers=1)
    command = [sys.executable, "-m", "lopa", "master", "--config", str(config)]
    master = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=worker_env())
    try:
        deadline = time.monotonic() + 60
        lines = []
        while time.monotonic() < deadline:  # wait until it listens (then it waits for its worker)
            line = master.stderr.readline()
            lines.append(line)
            if "master listening" in line or not line:
                break
        assert any("master listening" in line for line in lines), "".join(lines)
        master.send_signal(signal.SIGTERM)
        _, rest = master.communicate(timeout=30)
    finally:
        master.kill()
    assert master.returncode == 0, rest[-3000:]
    assert "Traceback" not in rest and "Exception ignored" not in rest, rest[-3000:]
