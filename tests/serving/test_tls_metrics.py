"""TLS on the client API (mutual, with a client CA) and the master's metrics endpoint."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from kube import certs
from lopa.serving.client import LopaClient
from lopa.serving.launcher import LocalCluster, loopback_config
from lopa.serving.ports import free_ports
from lopa.serving.shared.config import parse_config


def test_mutual_tls_and_metrics(checkpoint: Path, tmp_path: Path) -> None:
    try:
        pki = certs.make_pki(tmp_path / "pki", ["127.0.0.1"], ["localhost"])
    except certs.CertError as error:
        pytest.skip(str(error))
    metrics_port = free_ports(1)[0]
    raw = {
        "model": {"path": str(checkpoint)},
        "decoding": {"block_size": 8, "max_new_tokens": 16},
        "limits": {"max_new_tokens": 64, "max_prompt_tokens": 64},
        "master": {"metrics_port": metrics_port},
        "tls": {
            "cert": str(pki.apiserver.cert),
            "key": str(pki.apiserver.key),
            "client_ca": str(pki.ca.cert),
        },
    }
    config = loopback_config(parse_config(raw), workers=1)
    cluster = LocalCluster(config, tmp_path, log_dir=tmp_path)
    admin = pki.clients["admin"]
    try:
        cluster.master = cluster._spawn("master")  # no workers: the API answers, health is NOT_SERVING
        with LopaClient(cluster.address, ca=str(pki.ca.cert), cert=str(admin.cert), key=str(admin.key)) as c:
            deadline = time.monotonic() + 90
            while c.health() == "UNREACHABLE" and time.monotonic() < deadline:
                time.sleep(0.2)
            assert c.health() == "NOT_SERVING"
            assert c.model_info().workers == 1
            with pytest.raises(grpc.RpcError) as error:
                c.generate("hi", timeout=10)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        no_cert = LopaClient(cluster.address, ca=str(pki.ca.cert))  # the server requires a client cert
        with no_cert, pytest.raises(grpc.RpcError):
            no_cert.model_info(timeout=5)
        with LopaClient(cluster.address) as plaintext, pytest.raises(grpc.RpcError):
            plaintext.model_info(timeout=5)
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        assert 'lopa_requests_total{outcome="unavailable"} 1.0' in text
        for name in ("lopa_step_seconds", "lopa_queue_depth", "lopa_tpf", "lopa_workers_joined"):
            assert name in text
    finally:
        cluster.stop()
