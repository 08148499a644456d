"""A port picked free and taken by another process before its worker binds it.

`lopa serve` picks its workers' ports (and the rendezvous) free, then its children bind them: in
between, another process may take one. The worker that cannot bind exits PORT_TAKEN_EXIT, and the
launcher starts the group again on new ports instead of failing.
"""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from lopa.serving.client import LopaClient
from lopa.serving.launcher import LocalCluster, PortsTaken, loopback_config
from lopa.serving.shared.config import ServingConfig, parse_config
from lopa.serving.shared.listen import PORT_TAKEN_EXIT

from .conftest import worker_env, write_config


@contextmanager
def held_port() -> Iterator[int]:
    """A loopback port held (listening) by this process while the block runs: taken for a child."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def _config_on(checkpoint: Path, taken_port: int) -> tuple[dict, ServingConfig]:
    """(the raw config, the group's config with worker 0 on `taken_port`)."""
    raw = {"model": {"path": str(checkpoint)}, "decoding": {"block_size": 8, "max_new_tokens": 16},
           "master": {"metrics_port": 0}}
    config = loopback_config(parse_config(raw), workers=2)
    addresses = (f"127.0.0.1:{taken_port}", *config.workers.addresses[1:])
    return raw, dataclasses.replace(config, workers=dataclasses.replace(config.workers, addresses=addresses))


def test_a_worker_whose_port_is_taken_exits_with_the_port_taken_status(
    checkpoint: Path, tmp_path: Path
) -> None:
    with held_port() as port:
        config = write_config(tmp_path, checkpoint, 1)
        raw = yaml.safe_load(config.read_text())
        raw["workers"]["addresses"] = [f"127.0.0.1:{port}"]
        config.write_text(yaml.safe_dump(raw))
        command = [sys.executable, "-m", "lopa", "worker", "--config", str(config), "--rank", "0"]
        done = subprocess.run(command, env=worker_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == PORT_TAKEN_EXIT, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "workers.addresses" in done.stderr  # the config key


def test_the_launcher_starts_again_on_new_ports_when_a_picked_one_was_taken(
    checkpoint: Path, tmp_path: Path
) -> None:
    with held_port() as port:
        raw, first = _config_on(checkpoint, port)
        picks: list[int] = []

        def pick():  # what `lopa serve` does: the same flags, new free ports
            picks.append(1)
            return loopback_config(parse_config(raw), workers=2)

        cluster = LocalCluster(first, tmp_path, log_dir=tmp_path)
        secret = cluster.config.workers.secret_file
        try:
            address = cluster.start_on_free_ports(pick, timeout=120)
            with LopaClient(address) as client:
                assert client.generate([5, 17, 23], timeout=30).stats.forwards > 0
        finally:
            cluster.stop()
    assert picks == [1]
    assert cluster.config.workers.addresses != first.workers.addresses
    assert cluster.config.workers.secret_file == secret  # one group secret across the starts


def test_ports_taken_on_every_start_end_the_start_with_the_workers_words(
    checkpoint: Path, tmp_path: Path
) -> None:
    with held_port() as port:
        _, config = _config_on(checkpoint, port)
        cluster = LocalCluster(config, tmp_path, log_dir=tmp_path)
        try:
            with pytest.raises(PortsTaken, match="cannot listen on"):
                cluster.start_on_free_ports(lambda: config, timeout=120)
        finally:
            cluster.stop()


def test_a_master_whose_http_port_is_taken_ends_the_start_the_same_way(
    checkpoint: Path, tmp_path: Path
) -> None:
    with held_port() as port:
        raw = {"model": {"path": str(checkpoint)}, "decoding": {"block_size": 8, "max_new_tokens": 16},
               "master": {"metrics_port": 0, "http_port": port}}
        config = loopback_config(parse_config(raw), workers=1)
        cluster = LocalCluster(config, tmp_path, log_dir=tmp_path)
        try:
            with pytest.raises(PortsTaken, match=f"master.http_port: cannot listen on port {port}"):
                cluster.start_on_free_ports(lambda: config, timeout=120)
        finally:
            cluster.stop()
