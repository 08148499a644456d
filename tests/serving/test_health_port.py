"""master.health_port: grpc.health.v1 alone, in plaintext, beside a TLS client API (the kubelet's
gRPC probe speaks no TLS). It reports exactly the status of the TLS port: NOT_SERVING until the group
has formed, SERVING once it has, NOT_SERVING again when a worker is lost."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from kube import certs
from lopa.serving.client import LopaClient
from lopa.serving.launcher import LocalCluster, loopback_config
from lopa.serving.ports import free_ports
from lopa.serving.shared.config import ConfigError, parse_config, validate


def _wait_status(client: LopaClient, want: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    status = client.health(timeout=2.0)
    while status != want and time.monotonic() < deadline:
        time.sleep(0.2)
        status = client.health(timeout=2.0)
    return status


@pytest.mark.parametrize("port", [-1, 65536])
def test_health_port_out_of_range_is_refused(port: int) -> None:
    with pytest.raises(ConfigError, match=r"master\.health_port"):
        validate(parse_config({"master": {"health_port": port}}))


def test_health_port_default_is_off() -> None:
    assert parse_config({}).master.health_port == 0


def test_plaintext_health_port_beside_tls(checkpoint: Path, tmp_path: Path) -> None:
    try:
        pki = certs.make_pki(tmp_path / "pki", ["127.0.0.1"], ["localhost"])
    except certs.CertError as error:
        pytest.skip(str(error))
    health_port, metrics_port = free_ports(2)
    raw = {
        "model": {"path": str(checkpoint)},
        "decoding": {"block_size": 8, "max_new_tokens": 16},
        "limits": {"max_new_tokens": 64, "max_prompt_tokens": 64},
        "master": {"metrics_port": metrics_port, "health_port": health_port},
        "tls": {"cert": str(pki.apiserver.cert), "key": str(pki.apiserver.key)},
    }
    config = loopback_config(parse_config(raw), workers=1)
    assert config.master.health_port == health_port  # the launcher keeps the master's settings
    cluster = LocalCluster(config, tmp_path, log_dir=tmp_path)
    try:
        cluster.master = cluster._spawn("master")  # no workers yet: the group has not formed
        with LopaClient(f"127.0.0.1:{health_port}") as probe, LopaClient(
            cluster.address, ca=str(pki.ca.cert)
        ) as api:
            assert _wait_status(probe, "NOT_SERVING", 90) == "NOT_SERVING"
            assert probe.health("lopa.v1.Lopa") == "NOT_SERVING"
            assert api.health() == "NOT_SERVING"  # the TLS port tells the same
            with pytest.raises(grpc.RpcError) as error:  # the health port serves nothing else
                probe.model_info(timeout=5)
            assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED

            cluster.start_workers()
            assert _wait_status(probe, "SERVING", 180) == "SERVING"
            assert api.health() == "SERVING"

            cluster.stop_workers()  # a lost rank: both ports report it
            assert _wait_status(probe, "NOT_SERVING", 60) == "NOT_SERVING"
            assert api.health() == "NOT_SERVING"
    finally:
        cluster.stop()
