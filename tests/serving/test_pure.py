"""Pure serving logic: config file, placement, request validation, stream deltas, fused commit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lopa.execution.local import LocalExecutor
from lopa.model.loader import load_model
from lopa.params import DecodingParams, InvalidParameter
from lopa.proto import lopa_pb2
from lopa.serving.config import ConfigError, Limits, load_config, parse_config
from lopa.serving.placement import rank_of, shares
from lopa.serving.requests import build_params
from lopa.serving.shard import ShardExecutor
from lopa.serving.streaming import DeltaTracker

REPO = Path(__file__).resolve().parents[2]


def test_the_reference_config_file_parses() -> None:
    config = load_config(REPO / "docs" / "lopa.yaml")
    assert config.workers.count == len(config.workers.addresses) == 2
    assert config.decoding.branches == 7 and config.limits.queue_size == 64 and config.tls.enabled


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"workers": {"count": 2}}, "workers.addresses"),
        ({"workers": {"backend": "mpi"}}, "workers.backend"),
        ({"decoding": {"tau_conf": 2}}, "decoding.tau_conf"),
        ({"decoding": {"speed": 1}}, "decoding.speed"),
        ({"model": {"dtype": "float32"}, "extra": {}}, "extra"),
    ],
)
def test_config_errors_name_the_key(raw: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        parse_config(raw)


def test_round_robin_placement() -> None:
    assert shares(6, 2) == [[0, 2, 4], [1, 3, 5]]
    assert shares(2, 3) == [[0], [1], []]
    assert [rank_of(c, 3) for c in range(5)] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1)]


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


def test_deltas_hold_back_a_possible_stop_and_flush_at_the_end() -> None:
    vocab = {1: "ab", 2: "c", 3: "<", 4: "/", 5: "d", 9: ""}
    tracker = DeltaTracker(lambda ids: "".join(vocab[i] for i in ids), frozenset({9}), stop=("</",))
    mask = 0
    assert tracker.step([1, 0, 2], mask) == (0, [1], "a")  # "b" could start the stop: held back
    assert tracker.step([1, 2, 3, 0], mask) == (1, [2, 3], "bc")
    assert tracker.step([1, 2, 3, 4, 5], mask) == (3, [4, 5], "")  # the stop arrived: cut there
    assert tracker.finish("abc") == ""
    plain = DeltaTracker(lambda ids: "".join(vocab[i] for i in ids), frozenset({9}))
    assert plain.step([1, 9, 2], mask) == (0, [1, 9], "ab")  # nothing after the first EOS
    assert plain.finish("ab") == ""


def test_fused_commit_buffer_round_trips(checkpoint: Path) -> None:
    """The winner's single buffer (all layers' K/V + fp32 last logit) rebuilds the same state."""
    loaded = load_model(checkpoint)
    sent: list[torch.Tensor] = []
    winner = ShardExecutor(loaded.window_model(64), 0, lambda buf, src: sent.append(buf.clone()))
    receiver = ShardExecutor(
        loaded.window_model(64), 1, lambda buf, src: buf.copy_(sent[-1])
    )
    reference = LocalExecutor(loaded.window_model(64))
    params = DecodingParams(block_size=8, max_new_tokens=16, branches=1)
    from lopa.decoding.executor import BranchWindow

    rows = [BranchWindow([5, 6, 7, 8, 100, 100], [0, 0, 0, 0, 1, 1], [4, 5]),
            BranchWindow([5, 6, 7, 8, 100, 9], [0, 0, 0, 0, 1, 1], [4])]
    for ex in (winner, receiver, reference):
        ex.begin(params, 2)
    winner.verify_shard(0, 4, rows)
    reference.verify(0, 4, rows)
    receiver.verify_shard(0, 4, [])
    winner.commit_shard(4, 0, 1, broadcast=True)
    receiver.commit_shard(4, 0, 1, broadcast=True)
    reference.commit(1)
    assert len(sent) == 1 and sent[0].dtype == torch.uint8
    kv, ref_kv = receiver.window_model.kv, reference.model.kv
    assert kv.length == ref_kv.length == 4
    assert torch.equal(kv.cache[:, :, :4], ref_kv.cache[:, :, :4])
    assert torch.equal(receiver._last_logit, reference._last_logit)


def test_bench_serving_uses_held_out_prompts_and_model_defaults_on_the_bundled_model() -> None:
    import argparse

    from lopa.bundled import tasks
    from lopa.bundled.defaults import model_defaults
    from lopa.serving import bench
    from lopa.serving.model_dir import model_path

    def args(**kw: object) -> argparse.Namespace:
        base = {"model": None, "requests": 3, "concurrency": 4, "branches": 2, "block_size": None,
                "attention": None, "max_new_tokens": None}
        return argparse.Namespace(**{**base, **kw})

    kw, prompts = bench.workload(args())
    defaults = model_defaults(model_path(""))
    assert prompts == [e.prompt for e in tasks.held_out(bench.WARMUP + 4)]
    assert kw["branches"] == 2 and kw["block_size"] == defaults.block_size
    assert kw["tau_conf"] == defaults.tau_conf and kw["max_new_tokens"] == defaults.max_new_tokens
    assert kw["attention"] == defaults.attention.value and kw["conf"] == defaults.conf.value
    assert lopa_pb2.GenerateRequest(decoding={k: v for k, v in kw.items() if k != "max_new_tokens"})
    kw, _ = bench.workload(args(block_size=4, attention="block_causal", max_new_tokens=16))
    assert (kw["block_size"], kw["attention"], kw["max_new_tokens"]) == (4, "block_causal", 16)
    kw, prompts = bench.workload(args(model="/some/checkpoint"))
    assert prompts == bench.PROMPTS and kw == {"attention": "full", "max_new_tokens": 64, "branches": 2}
