"""Pure serving logic: config file, placement, request validation, stream deltas, fused commit."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from lopa.execution.local import LocalExecutor
from lopa.execution.placement import candidates_on, rank_of, shares
from lopa.execution.shard import ShardExecutor
from lopa.model.loader import load_model
from lopa.params import DecodingParams, InvalidParameter
from lopa.proto import lopa_pb2
from lopa.serving.master.requests import build_params
from lopa.serving.master.streaming import DeltaTracker
from lopa.serving.shared.config import ConfigError, Limits, load_config, parse_config

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


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"model": {"dtype": "float8"}}, r"model\.dtype: must be one of float32, bfloat16, float16, got 'fl"),
        ({"model": {"device": "tpu"}}, r"model\.device: must be cpu, cuda\[:N\] or npu\[:N\], got 'tpu'"),
        ({"model": {"device": "cuda:x"}}, r"model\.device: must be cpu"),
        ({"model": {"device": "cuda"}, "workers": {"backend": "hccl"}},
         r"workers\.backend: 'hccl' does not match model\.device 'cuda' \(use nccl, or gloo for sev"),
        ({"model": {"device": "npu"}, "workers": {"backend": "gloo"}},
         r"workers\.backend: 'gloo' does not match model\.device 'npu' \(use hccl\)"),
        ({"model": {"device": "cpu"}, "workers": {"backend": "nccl"}},
         r"workers\.backend: 'nccl' does not match model\.device 'cpu' \(use gloo\)"),
        ({"master": {"listen": "not-an-address"}}, r"master\.listen: must be HOST:PORT"),
        ({"master": {"listen": "127.0.0.1:99999"}}, r"master\.listen: port must be in \[1, 65535\], got 9"),
        ({"master": {"metrics_port": 99999}}, r"master\.metrics_port: must be in \[0, 65535\], got 99999"),
        ({"workers": {"listen_port": 70000}}, r"workers\.listen_port: must be in \[0, 65535\], got 70000"),
        ({"workers": {"metrics_port": -1}}, r"workers\.metrics_port: must be in \[0, 65535\]"),
        ({"workers": {"addresses": ["worker-0"]}}, r"workers\.addresses\[0\]: must be HOST:PORT"),
        ({"workers": {"rendezvous": "host:0"}}, r"workers\.rendezvous: port must be in \[1, 65535\]"),
        ({"limits": {"request_timeout_s": -1}}, r"request_timeout_s: must be > 0 \(seconds\), got -1"),
        ({"workers": {"step_timeout_s": 0}}, r"workers\.step_timeout_s: must be > 0"),
        ({"workers": {"join_timeout_s": -5}}, r"workers\.join_timeout_s: must be > 0"),
        ({"limits": {"max_branches": 15.5}}, r"limits\.max_branches: must be an integer, got 15\.5"),
        ({"limits": {"max_branches": 65}}, r"limits\.max_branches: must be in \[1, 64\], got 65"),
        ({"limits": {"queue_size": 0}}, r"limits\.queue_size: must be >= 1, got 0"),
        ({"decoding": {"branches": True}}, r"decoding\.branches: must be an integer, got True"),
        ({"decoding": {"block_size": 8.5}}, r"decoding\.block_size: must be an integer, got 8\.5"),
        ({"decoding": {"tau_conf": False}}, r"decoding\.tau_conf: must be a number, got False"),
        ({"workers": {"count": "2"}}, r"workers\.count: must be an integer, got '2'"),
    ],
)
def test_config_values_are_checked_with_their_range(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


def test_config_accepts_device_indices_and_the_off_ports() -> None:
    config = parse_config({"model": {"device": "cuda:1"}, "workers": {"backend": "nccl", "listen_port": 0},
                           "master": {"listen": "[::]:50051", "metrics_port": 0}})
    assert config.model.device == "cuda:1" and config.master.metrics_port == 0
    assert parse_config({"limits": {"request_timeout_s": 5}}).limits.request_timeout_s == 5.0


def test_round_robin_placement() -> None:
    assert shares(6, 2) == [[0, 2, 4], [1, 3, 5]]
    assert shares(2, 3) == [[0], [1], []]
    assert [rank_of(c, 3) for c in range(5)] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1)]


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_each_rank_recovers_its_candidates_from_its_slots(workers: int) -> None:
    for candidates in range(1, 10):
        for offset in range(6):
            for rank, mine in enumerate(shares(candidates, workers, offset)):
                assert candidates_on(rank, len(mine), workers, offset) == mine
                assert all(rank_of(c, workers, offset) == (rank, slot) for slot, c in enumerate(mine))


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
    assert tracker.step([1, 2, 3, 0], mask) == (1, [2], "bc")  # "<" too, and its token
    # The stop arrived: the text is cut there and no id past it is sent (before the fix: [3, 4, 5]).
    assert tracker.step([1, 2, 3, 4, 5], mask) == (2, [], "")
    assert tracker.finish("abc", [1, 2]) == (2, [], "")
    plain = DeltaTracker(lambda ids: "".join(vocab[i] for i in ids), frozenset({9}))
    assert plain.step([1, 9, 2], mask) == (0, [1], "ab")  # nothing after the first EOS
    assert plain.finish("ab", [1, 9]) == (1, [9], "")  # the EOS, which has no text, comes last


def test_the_last_chunk_carries_the_ids_held_back() -> None:
    vocab = {1: "a", 2: "b", 3: "<"}
    tracker = DeltaTracker(lambda ids: "".join(vocab[i] for i in ids), frozenset(), stop=("<<",))
    assert tracker.step([1, 2, 3], 0) == (0, [1, 2], "ab")  # "<" might begin "<<"
    assert tracker.finish("ab<", [1, 2, 3]) == (2, [3], "<")  # the answer ended without the stop


def test_fused_commit_buffer_round_trips(checkpoint: Path) -> None:
    """Two requests won on one rank travel in ONE broadcast (each request's K/V of every layer + its
    fp32 last logit) and rebuild, on the receiver, the state of running each request locally."""
    from lopa.decoding.executor import BranchWindow
    from lopa.execution.local import VerifyPart
    from lopa.execution.shard import CommitOrder

    loaded = load_model(checkpoint)
    sent: list[torch.Tensor] = []
    winner = ShardExecutor(loaded.window_model(64, max_batch=3), 0, lambda buf, src: sent.append(buf.clone()))
    receiver = ShardExecutor(loaded.window_model(64, max_batch=3), 1, lambda buf, src: buf.copy_(sent[-1]))
    reference = LocalExecutor(loaded.window_model(64, max_batch=3))
    params = DecodingParams(block_size=8, max_new_tokens=16, branches=1)
    rows = {
        0: [BranchWindow([5, 6, 7, 8, 100, 100], [0, 0, 0, 0, 1, 1], [4, 5]),
            BranchWindow([5, 6, 7, 8, 100, 9], [0, 0, 0, 0, 1, 1], [4])],
        2: [BranchWindow([9, 3, 100, 100, 100], [0, 0, 1, 1, 1], [2, 3, 4]),
            BranchWindow([9, 3, 4, 100, 100], [0, 0, 1, 1, 1], [3, 4])],
    }
    n_stage = {0: 4, 2: 2}
    for ex in (winner, receiver, reference):
        for sequence in rows:
            ex.begin(params, 2, sequence)
    winner.verify_round([VerifyPart(s, 0, n_stage[s], rows[s]) for s in rows])
    reference.verify_many([VerifyPart(s, 0, n_stage[s], rows[s]) for s in rows])
    receiver.verify_round([VerifyPart(s, 0, n_stage[s], []) for s in rows])
    commits = [CommitOrder(0, 4, 0, 1, True), CommitOrder(2, 2, 0, 0, True)]
    winner.commit_round(commits)
    receiver.commit_round(commits)
    reference.commit_many([(0, 1), (2, 0)])
    assert len(sent) == 1 and sent[0].dtype == torch.uint8  # one fused broadcast for both requests
    for sequence, n in n_stage.items():
        kv, ref_kv = receiver.model.caches[sequence], reference.model.caches[sequence]
        assert kv.length == ref_kv.length == n
        assert torch.equal(kv.cache[:, :, :n], ref_kv.cache[:, :, :n])
        assert torch.equal(receiver.local.state(sequence).last_logit, reference.state(sequence).last_logit)


def test_bench_serving_uses_held_out_prompts_and_model_defaults_on_the_bundled_model() -> None:
    import argparse

    from lopa.bench import serving as bench
    from lopa.bundled import tasks
    from lopa.bundled.defaults import model_defaults
    from lopa.serving.shared.model_dir import model_path

    def args(**kw: object) -> argparse.Namespace:
        base = {"model": None, "branches": 2, "block_size": None, "attention": None, "max_new_tokens": None}
        return argparse.Namespace(**{**base, **kw})

    kw, prompts = bench.workload(args(), 4)
    defaults = model_defaults(model_path(""))
    assert prompts == [e.prompt for e in tasks.held_out(bench.WARMUP + 4)]
    assert kw["branches"] == 2 and kw["block_size"] == defaults.block_size
    assert kw["tau_conf"] == defaults.tau_conf and kw["max_new_tokens"] == defaults.max_new_tokens
    assert kw["attention"] == defaults.attention.value and kw["conf"] == defaults.conf.value
    assert lopa_pb2.GenerateRequest(decoding={k: v for k, v in kw.items() if k != "max_new_tokens"})
    kw, _ = bench.workload(args(block_size=4, attention="block_causal", max_new_tokens=16), 4)
    assert (kw["block_size"], kw["attention"], kw["max_new_tokens"]) == (4, "block_causal", 16)
    kw, prompts = bench.workload(args(model="/some/checkpoint"), 4)
    assert prompts == bench.PROMPTS and kw == {"attention": "full", "max_new_tokens": 64, "branches": 2}


def test_a_config_without_decoding_serves_with_the_models_own_defaults() -> None:
    from lopa.bundled.defaults import model_defaults
    from lopa.serving.shared.config import with_model_defaults
    from lopa.serving.shared.model_dir import model_path

    bundled = model_path("")
    model = model_defaults(bundled)
    assert model.block_size != DecodingParams().block_size  # the test needs a model with its own defaults
    assert with_model_defaults(parse_config({}), bundled).decoding == model
    partial = with_model_defaults(parse_config({"decoding": {"branches": 3, "tau_conf": 0.8}}), bundled)
    assert partial.decoding == model.with_overrides(branches=3, tau_conf=0.8)  # the file's keys win
    full = parse_config({"decoding": {"block_size": 16}})
    assert with_model_defaults(with_model_defaults(full, bundled), bundled).decoding.block_size == 16


def test_a_key_given_twice_is_refused(tmp_path: Path) -> None:
    """Issue 10, finding 8: YAML kept the last value silently."""
    path = tmp_path / "lopa.yaml"
    path.write_text("decoding:\n  branches: 1\n  tau_conf: 0.8\n  branches: 3\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value).startswith(f"{path}: not valid YAML: duplicate key 'branches' (line 4)")


def test_yaml_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "lopa.yaml"
    path.write_text("decoding: [1,\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert f'in "{path}"' in str(error.value) and "<unicode string>" not in str(error.value)


def test_unknown_keys_list_the_known_ones_in_the_documented_order() -> None:
    with pytest.raises(ConfigError) as error:
        parse_config({"decoding": {"nope": 1}})
    known = ", ".join(f.name for f in dataclasses.fields(DecodingParams))
    assert str(error.value) == f"decoding.nope: unknown key (known: {known})"


def test_kv_caches_that_cannot_fit_fail_at_start_naming_max_batch() -> None:
    from lopa.serving.shared.model_dir import check_kv_fits, kv_cache_bytes
    from lopa.synthetic import tiny_config

    model = tiny_config()
    config = parse_config({"limits": {"max_batch": 256}})
    huge = 1 << 34  # tokens per cache: no machine has that much memory for 256 of them
    with pytest.raises(ConfigError, match=r"^limits\.max_batch: 256 KV caches of 17179869184 tokens need "):
        check_kv_fits(config, model, huge, torch.device("cpu"), element_size=4)
    fits = check_kv_fits(config, model, 64, torch.device("cpu"), element_size=4)
    assert fits == kv_cache_bytes(model, 64, 256, 4) == 256 * 64 * model.num_hidden_layers * 2 * (
        model.num_key_value_heads * model.head_dim * 4)
