"""Only a group's master drives its workers, only its members join it.

A real master + 2 workers (`LocalCluster`, which gives every group a fresh secret, as `lopa serve`
does). A stranger who reaches the worker ports and the rendezvous store, without the secret or with
another, is refused with UNAUTHENTICATED and changes nothing: a request in flight finishes token for
token as alone, and the group serves on. With workers.tls_* the link is mutual TLS: a plaintext
client and a client of another CA are refused.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kube import certs
from lopa.bundled import bundled_model_dir, tasks
from lopa.proto import worker_pb2, worker_pb2_grpc
from lopa.serving.client import LopaClient
from lopa.serving.launcher import LocalCluster, loopback_config
from lopa.serving.shared.config import parse_config, with_model_defaults

PROMPT = tasks.held_out(1)[0].prompt


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    raw = {"master": {"metrics_port": 0}}
    config = loopback_config(with_model_defaults(parse_config(raw), bundled_model_dir()), workers=2)
    work = tmp_path_factory.mktemp("auth")
    started = LocalCluster(config, work, log_dir=work)
    started.start(timeout=180)
    yield started
    started.stop()


def refused(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as error:
        call()  # type: ignore[operator]
    return error.value.code()


def stranger_calls(address: str, rendezvous: str, metadata: tuple = ()) -> dict[str, grpc.StatusCode]:
    """Every kind of call a stranger could make, and the status each got."""
    with grpc.insecure_channel(address) as channel, grpc.insecure_channel(rendezvous) as store_channel:
        worker = worker_pb2_grpc.WorkerStub(channel)
        store = worker_pb2_grpc.RendezvousStub(store_channel)
        steps = worker.Steps(iter([worker_pb2.StepRequest()]), timeout=10, metadata=metadata)
        op = worker_pb2.StoreRequest
        return {
            "Info": refused(lambda: worker.Info(worker_pb2.InfoRequest(), timeout=10, metadata=metadata)),
            "Leave": refused(lambda: worker.Leave(worker_pb2.LeaveRequest(reason="stranger says bye"),
                                                  timeout=10, metadata=metadata)),
            "Steps": refused(lambda: next(steps)),
            "store set": refused(lambda: store.Store(op(op=op.SET, keys=["rank_0"], value=b"x"), timeout=10,
                                                     metadata=metadata)),
            "store get": refused(lambda: store.Store(op(op=op.GET, keys=["rank_0"], timeout_s=1), timeout=10,
                                                     metadata=metadata)),
        }


def test_a_stranger_is_refused_and_changes_nothing(cluster: LocalCluster) -> None:
    workers = cluster.config.workers
    assert workers.secret_file and Path(workers.secret_file).stat().st_mode & 0o077 == 0  # owner only
    kwargs = {"branches": 3, "max_new_tokens": 200, "ignore_eos": True}
    with LopaClient(cluster.address) as client:
        alone = client.generate(PROMPT, timeout=120, **kwargs)
        in_flight: list[object] = []
        def decode() -> None:
            in_flight.append(client.generate(PROMPT, timeout=120, **kwargs))

        thread = threading.Thread(target=decode)
        thread.start()
        for address in workers.addresses:
            for metadata in ((), (("authorization", "Bearer not-the-secret"),)):
                codes = stranger_calls(address, workers.rendezvous, metadata)
                assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, codes
        thread.join(timeout=120)
        assert in_flight and list(in_flight[0].token_ids) == list(alone.token_ids)  # type: ignore[attr-defined]
        assert client.health() == "SERVING"
        assert list(client.generate(PROMPT, timeout=120, **kwargs).token_ids) == list(alone.token_ids)
    assert cluster.restarts == 0


def link_pki(directory: Path) -> tuple[certs.KeyPair, certs.KeyPair]:
    """A CA and one certificate for the group's link, server and client at once."""
    pki = certs.make_pki(directory, ["127.0.0.1"], ["localhost"])
    link = certs._signed_cert(directory, "link", "/CN=lopa-group", pki.ca,
                              "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                              "extendedKeyUsage=serverAuth,clientAuth\n")
    return pki.ca, link


def test_with_tls_the_worker_link_is_mutual_tls(tmp_path: Path) -> None:
    try:
        ca, link = link_pki(tmp_path / "pki")
        foreign_ca, foreign = link_pki(tmp_path / "foreign")
    except certs.CertError as error:
        pytest.skip(str(error))
    raw = {"master": {"metrics_port": 0},
           "workers": {"tls_cert": str(link.cert), "tls_key": str(link.key), "tls_ca": str(ca.cert)}}
    config = loopback_config(with_model_defaults(parse_config(raw), bundled_model_dir()), workers=2)
    cluster = LocalCluster(config, tmp_path, log_dir=tmp_path)
    try:
        cluster.start(timeout=180)
        with LopaClient(cluster.address) as client:  # the master reached its workers over mTLS
            assert client.generate(PROMPT, timeout=120, branches=3).token_ids
        address = config.workers.addresses[0]
        with grpc.insecure_channel(address) as plaintext:
            assert refused(lambda: worker_pb2_grpc.WorkerStub(plaintext).Info(
                worker_pb2.InfoRequest(), timeout=5)) == grpc.StatusCode.UNAVAILABLE
        credentials = grpc.ssl_channel_credentials(ca.cert.read_bytes(), foreign.key.read_bytes(),
                                                   foreign.cert.read_bytes())
        with grpc.secure_channel(address, credentials) as other_ca:
            assert refused(lambda: worker_pb2_grpc.WorkerStub(other_ca).Info(
                worker_pb2.InfoRequest(), timeout=5)) == grpc.StatusCode.UNAVAILABLE
        assert foreign_ca.cert != ca.cert
    finally:
        cluster.stop()
