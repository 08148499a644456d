"""No valid request takes a worker group down.

Every numeric knob at the edges of its accepted range, alone and combined, as request overrides
and as the config's decoding defaults, against a real 2-worker group: each request succeeds or
gets INVALID_ARGUMENT naming the field, and the worker processes are the same ones afterwards.
A temperature of 1e-40, for one, must not make a worker exit (NaN probabilities in
torch.multinomial) and the whole group restart.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from lopa.proto import lopa_pb2
from lopa.serving.client import LopaClient
from lopa.serving.launcher import LocalCluster, loopback_config
from lopa.serving.shared.config import parse_config

PROMPT = [5, 17, 23, 42, 8, 9, 30]
TINY = 5e-324  # the smallest positive double
HUGE = 1.7976931348623157e308  # the largest finite double
MAX_BRANCHES = 6

VALID = [
    {"temperature": TINY, "top_p": TINY, "top_k": 1},
    {"temperature": 1e-300, "top_k": 2**32 - 1, "top_p": 1.0},
    {"temperature": 1e-40, "branches": MAX_BRANCHES, "attention": "block_causal"},
    {"temperature": HUGE, "top_p": 0.5, "seed": 2**64 - 1},
    {"temperature": 1e-300, "branches": MAX_BRANCHES, "conf": "margin", "top_k": 2},
    {"tau_conf": 0.0, "tau_add": 0.0, "tau_act": 0.0},
    {"tau_conf": 1.0, "tau_add": 1.0, "tau_act": 1.0, "branches": 2},
    {"alpha": 1.0, "beta": TINY, "branches": 3},
    {"alpha": 0.0, "beta": 1.0, "conf": "prob", "temperature": 1e-40},
    {"block_size": 1, "max_new_tokens": 1},
    {"block_size": 1, "branches": MAX_BRANCHES, "temperature": 1e-300},
    {"block_size": 32, "max_new_tokens": 32},
]

INVALID = [
    ({"temperature": math.inf}, "decoding.temperature"),
    ({"temperature": math.nan}, "decoding.temperature"),
    ({"top_p": 0.0}, "decoding.top_p"),
    ({"beta": 0.0}, "decoding.beta"),
    ({"tau_conf": 1.0000001}, "decoding.tau_conf"),
    ({"alpha": -TINY}, "decoding.alpha"),
    ({"block_size": 0}, "decoding.block_size"),
    ({"branches": MAX_BRANCHES + 1}, "decoding.branches"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
]

# The same edges as the server's defaults: every request without overrides uses them.
EXTREME_DEFAULTS = [
    {"temperature": 1e-300, "top_p": TINY, "top_k": 1, "beta": TINY, "alpha": 1.0, "seed": 2**64 - 1,
     "tau_conf": 1.0, "tau_add": 0.0, "tau_act": 0.0, "block_size": 1, "branches": MAX_BRANCHES},
    {"temperature": HUGE, "tau_conf": 0.0, "tau_add": 1.0, "tau_act": 1.0, "conf": "margin"},
]


def start_cluster(checkpoint: Path, work: Path, decoding: dict) -> LocalCluster:
    raw = {
        "model": {"path": str(checkpoint)},
        "decoding": {"block_size": 8, "max_new_tokens": 32, **decoding},
        "limits": {"max_branches": MAX_BRANCHES, "max_new_tokens": 64, "max_prompt_tokens": 64},
        "master": {"metrics_port": 0},
        "workers": {"join_timeout_s": 60, "step_timeout_s": 20},
    }
    cluster = LocalCluster(loopback_config(parse_config(raw), workers=2), work, log_dir=work)
    cluster.start(timeout=120)
    return cluster


def assert_same_workers(cluster: LocalCluster, pids: list[int]) -> None:
    assert [p.pid for p in cluster.workers] == pids
    assert all(p.poll() is None for p in cluster.workers), "a worker exited"
    assert cluster.restarts == 0


@pytest.fixture(scope="module")
def cluster(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = start_cluster(checkpoint, tmp_path_factory.mktemp("extremes"), {})
    yield cluster
    cluster.stop()


def test_edges_of_every_knob_succeed_without_a_restart(cluster: LocalCluster) -> None:
    pids = [p.pid for p in cluster.workers]
    with LopaClient(cluster.address) as client:
        for overrides in VALID:
            reply = client.generate(PROMPT, timeout=60, **overrides)
            assert reply.stats.forwards > 0, overrides
        chunks = list(client.stream(PROMPT, timeout=60, **VALID[0]))
        assert chunks[-1].HasField("stats")
        assert client.health() == "SERVING"
    assert_same_workers(cluster, pids)


def test_values_outside_the_ranges_name_their_field_without_a_restart(cluster: LocalCluster) -> None:
    pids = [p.pid for p in cluster.workers]
    with LopaClient(cluster.address) as client:
        for overrides, field in INVALID:
            # Built by hand: LopaClient itself refuses some of these (0 tokens) before sending.
            request = lopa_pb2.GenerateRequest(prompt_token_ids=PROMPT)
            for name, value in overrides.items():
                setattr(request if name == "max_new_tokens" else request.decoding, name, value)
            with pytest.raises(grpc.RpcError) as error:
                client.stub.Generate(request, timeout=60)
            assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT, overrides
            assert error.value.details().startswith(f"{field}:"), (overrides, error.value.details())
    assert_same_workers(cluster, pids)


@pytest.mark.parametrize("defaults", EXTREME_DEFAULTS, ids=["vanishing", "huge"])
def test_edges_as_config_defaults_serve_every_request(
    checkpoint: Path, tmp_path: Path, defaults: dict
) -> None:
    cluster = start_cluster(checkpoint, tmp_path, defaults)
    try:
        pids = [p.pid for p in cluster.workers]
        with LopaClient(cluster.address) as client:
            for _ in range(2):
                assert client.generate(PROMPT, timeout=60).stats.forwards > 0
        assert_same_workers(cluster, pids)
    finally:
        cluster.stop()
