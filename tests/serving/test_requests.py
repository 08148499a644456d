"""A client request -> validated decoding parameters (lopa.serving.master.requests)."""

from __future__ import annotations

import pytest

from lopa.params import DecodingParams, InvalidParameter
from lopa.proto import lopa_pb2
from lopa.serving.master.requests import build_params
from lopa.serving.shared.config import Limits


def test_request_overrides_within_limits() -> None:
    limits = Limits(max_branches=4, max_new_tokens=64)
    request = lopa_pb2.GenerateRequest(prompt="x", max_new_tokens=48)
    request.decoding.branches, request.decoding.tau_conf = 3, 0.5
    params = build_params(request, DecodingParams(block_size=16), limits)
    assert (params.branches, params.tau_conf, params.max_new_tokens, params.block_size) == (3, 0.5, 48, 16)
    for name, value, field in [
        ("branches", 5, "decoding.branches"),
        ("tau_add", -0.1, "decoding.tau_add"),
        ("conf", "loud", "decoding.conf"),
        ("top_p", float("nan"), "decoding.top_p"),
    ]:
        bad = lopa_pb2.GenerateRequest(prompt="x")
        setattr(bad.decoding, name, value)
        with pytest.raises(InvalidParameter) as error:
            build_params(bad, DecodingParams(), limits)
        assert error.value.field == field
    with pytest.raises(InvalidParameter) as error:
        build_params(lopa_pb2.GenerateRequest(prompt="x", max_new_tokens=65), DecodingParams(), limits)
    assert error.value.field == "max_new_tokens"
