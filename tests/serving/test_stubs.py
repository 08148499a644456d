"""The checked-in gRPC stubs are exactly what protos/lopa/v1 compiles to."""

from __future__ import annotations

from pathlib import Path

import pytest

from lopa.proto import generate


def test_stubs_are_current(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    written = generate.generate(tmp_path)
    assert {p.name for p in written} == {
        "lopa_pb2.py",
        "lopa_pb2_grpc.py",
        "worker_pb2.py",
        "worker_pb2_grpc.py",
    }
    for fresh in written:
        checked_in = generate.HERE / fresh.name
        assert checked_in.read_text() == fresh.read_text(), (
            f"{checked_in} is stale: run `python -m lopa.proto.generate`"
        )


def test_stubs_import() -> None:
    from lopa.proto import lopa_pb2, lopa_pb2_grpc, worker_pb2, worker_pb2_grpc

    assert lopa_pb2_grpc.LopaStub and worker_pb2_grpc.WorkerStub
    request = lopa_pb2.GenerateRequest(prompt="hi", decoding=lopa_pb2.DecodingOverrides(branches=3))
    assert request.decoding.HasField("branches") and not request.decoding.HasField("tau_conf")
    step = worker_pb2.RequestStep(sequence=1, windows=[worker_pb2.Window(tokens=[1, 2])])
    assert worker_pb2.StepRequest(requests=[step]).requests[0].windows[0].tokens == [1, 2]
