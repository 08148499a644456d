"""`lopa serve --workers 2 --prompt ...`: launcher, master, workers and client end to end."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from kube import certs
from lopa.params import InvalidParameter
from lopa.serving.client import LopaClient
from lopa.serving.ports import free_ports

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
    if not torch.cuda.is_available():  # no device given: auto finds the CPU here, and says so
        chosen = ("device cpu (auto: no CUDA or NPU device found), dtype float32, "
                  "collective backend gloo (auto)")
        assert chosen in done.stderr and "(on cpu): SERVING" in done.stderr


def _tls_config(tmp_path: Path, checkpoint: Path) -> tuple[Path, certs.ClusterPKI]:
    try:
        pki = certs.make_pki(tmp_path / "pki", ["127.0.0.1"], ["localhost"])
    except certs.CertError as error:
        pytest.skip(str(error))
    raw = {
        "model": {"path": str(checkpoint)},
        "decoding": {"block_size": 8, "max_new_tokens": 16},
        "limits": {"max_new_tokens": 64, "max_prompt_tokens": 64},
        "workers": {"count": 1},
        "tls": {"cert": str(pki.apiserver.cert), "key": str(pki.apiserver.key)},
    }
    path = tmp_path / "lopa.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path, pki


def test_serve_with_tls_in_its_config_file_starts(checkpoint: Path, tmp_path: Path) -> None:
    """The launcher has no client certificate: it waits for SERVING on a plaintext health port (before,
    its plaintext health check failed the TLS handshake until --start-timeout ran out)."""
    config, pki = _tls_config(tmp_path, checkpoint)
    address = f"127.0.0.1:{free_ports(1)[0]}"
    command = [sys.executable, "-m", "lopa", "serve", "--config", str(config), "--listen", address,
               "--start-timeout", "120"]
    serve = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=worker_env())
    try:
        line = serve.stdout.readline()  # the "serving on" line, or "" once it gave up
        assert line.startswith(f"lopa: serving on {address}"), serve.communicate(timeout=30)[1][-3000:]
        with LopaClient(address, ca=str(pki.ca.cert)) as client:
            assert client.health() == "SERVING"
            assert client.generate("12+34=", timeout=60).stats.forwards >= 1
        serve.send_signal(signal.SIGINT)
        serve.communicate(timeout=60)
    finally:
        serve.kill()
    assert serve.returncode == 0


def test_serve_refuses_a_one_shot_prompt_under_tls(checkpoint: Path, tmp_path: Path) -> None:
    config, _ = _tls_config(tmp_path, checkpoint)
    command = [sys.executable, "-m", "lopa", "serve", "--config", str(config), "--prompt", "12+34="]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=worker_env())
    assert done.returncode == 2, done.stderr[-3000:]
    assert "lopa serve: error: --prompt: sends its request without TLS" in done.stderr


def test_serve_without_a_model_fails_fast(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "lopa", "serve", "--workers", "2", "--model", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=worker_env())
    assert done.returncode == 2, done.stderr
    expected = f"lopa serve: error: --model: '{tmp_path}' is not a checkpoint directory (no config.json)"
    assert expected in done.stderr


def test_an_unknown_flag_is_refused_with_its_commands_usage() -> None:
    command = [sys.executable, "-m", "lopa", "serve", "--bogus"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=worker_env())
    assert done.returncode == 2 and "usage: lopa serve" in done.stderr
    assert "lopa serve: error: unrecognized arguments: --bogus" in done.stderr


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


def test_serve_places_its_workers_and_rendezvous_on_the_ports_asked() -> None:
    from lopa.cli import build_parser
    from lopa.cli.serve import check_flags, serving_config

    # check_flags probes each port: one picked free (or the worker port's successor, not picked) may be
    # taken by another test process before the probe, so a taken port means new ports, not a failure.
    for attempt in range(5):
        worker, rendezvous = free_ports(2)
        if rendezvous == worker + 1:  # the second worker's port: the other way round, it lies below
            worker, rendezvous = rendezvous, worker
        args = build_parser("serve").parse_args(["serve", "--workers", "2", "--worker-port", str(worker),
                                                 "--rendezvous-port", str(rendezvous)])
        try:
            check_flags(args)
            break
        except InvalidParameter as taken:
            if "already in use" not in str(taken) or attempt == 4:
                raise
    config = serving_config(args)
    assert config.workers.addresses == (f"127.0.0.1:{worker}", f"127.0.0.1:{worker + 1}")
    assert config.workers.rendezvous == f"127.0.0.1:{rendezvous}"
    flags = ["serve", "--worker-port", "50050", "--listen", "127.0.0.1:50051"]
    clash = build_parser("serve").parse_args(flags)
    with pytest.raises(InvalidParameter, match="the workers' ports 50050-50051 hold --listen's 50051"):
        check_flags(clash)
