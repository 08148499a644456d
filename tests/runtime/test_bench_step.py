"""`lopa bench step` and `lopa bench write-checkpoint` end to end on the CPU (a tiny preset).

They check the tables are well formed and consistent, never how fast anything is: timings belong in
runtime/BENCHMARKS.md (GPU numbers come from a GPU machine).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lopa.cli import main
from lopa.model.loader import load_model
from lopa.model.lora import lora_delta, read_adapter
from lopa_bench.step import suggested_step_tokens

SMALL = ["--device", "cpu", "--dtype", "float32", "--repeat", "2", "--copy-gb", "0.01"]


def test_bench_step_reports_forwards_steps_and_products(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "step.json"
    grid = ["--rows", "1,2", "--widths", "8,16", "--caches", "0,24"]
    steps = ["--ks", "0,1,3", "--step-widths", "8", "--step-cache", "16"]
    rounds = ["--batches", "1,3,2", "--batch-k", "2"]
    args = ["bench", "step", "--preset", "tiny", *SMALL, *grid, *steps, *rounds, "--gemm", "--json", str(out),
            "--profile", str(tmp_path / "profile")]
    assert main(args) == 0
    profile = (tmp_path / "profile" / "step_profile.txt").read_text()
    assert profile.startswith("== ") and "aten::" in profile  # a table of the ops of each case
    report = json.loads(out.read_text())
    setup, rows = report["setup"], report["rows"]
    assert setup["device"] == "cpu" and setup["floor_ms"] > 0 and setup["copy_TBps"] > 0
    forwards = [r for r in rows if r["kind"] == "forward"]
    assert [(r["rows"], r["window"], r["cache"]) for r in forwards] == [
        (1, 8, 0), (1, 16, 0), (2, 8, 0), (2, 16, 0), (1, 8, 24), (1, 16, 24), (2, 8, 24), (2, 16, 24)
    ]
    for row in forwards:
        assert row["ms"] > 0 and row["tokens"] == row["rows"] * row["window"]
        assert row["x_floor"] == pytest.approx(row["ms"] / setup["floor_ms"], rel=0.05)
    steps = [r for r in rows if r["kind"] == "step"]
    assert [r["k"] for r in steps] == [0, 1, 3]
    assert steps[0]["x_d2f"] == 1.0 and all(r["rows"] == r["k"] + 1 for r in steps)
    assert all(r["tok_s_at_tpf_10.1"] == pytest.approx(10.1e3 / r["ms"], rel=0.01) for r in steps)
    rounds = [r for r in rows if r["kind"] == "round"]
    assert [r["requests"] for r in rounds] == [1, 3, 2]
    lone_ms = rounds[0]["ms"]
    for row in rounds:  # each request: k + 1 rows of the first step width over the step cache
        assert (row["k"], row["window"], row["cache"]) == (2, 8, 16)
        assert row["rows"] == 3 * row["requests"] and row["tokens"] == row["rows"] * 8
        assert row["x_lone"] == pytest.approx(row["ms"] / (row["requests"] * lone_ms), rel=0.05)
        assert row["tok_s_at_tpf_10.1"] == pytest.approx(row["requests"] * 10.1e3 / row["ms"], rel=0.01)
        assert row["graphed"] is False  # CPU: no CUDA graphs
    assert {r["weight"] for r in rows if r["kind"] == "gemm"} == {"qkv", "o", "gate_up", "down", "lm_head"}
    printed = capsys.readouterr().out
    assert "| rows | window |" in printed and "| k | rows |" in printed  # a table per kind
    assert "| requests | k | rows |" in printed
    assert setup["suggested_max_step_tokens"] == suggested_step_tokens(rounds)
    assert f"suggested limits.max_step_tokens: {setup['suggested_max_step_tokens']}" in printed


def test_suggested_step_tokens_follows_the_workers_rule() -> None:
    # The H100 7B rounds of runtime/BENCHMARKS.md (k = 3, cache 512, 9331b88).
    measured = [(128, 9.42), (256, 11.54), (512, 17.92), (1024, 33.42), (2048, 65.76)]
    rounds = [{"tokens": tokens, "ms": ms} for tokens, ms in measured]
    assert suggested_step_tokens(rounds) == 512
    assert suggested_step_tokens(rounds, factor=4.0) == 1024
    flat = [{"tokens": tokens, "ms": 3.0 + tokens / 1e4} for tokens, _ in measured]  # launch-bound
    assert suggested_step_tokens(flat) == 1024  # at most the workers' largest size
    assert suggested_step_tokens([]) is None and suggested_step_tokens(rounds[-1:]) is None


def test_bench_step_refuses_bad_lists(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "step", "--preset", "tiny", *SMALL, "--rows", "0,2"])
    assert exit_info.value.code == 2
    assert "--rows: each value must be an integer [1, 64], got '0'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "step", "--preset", "tiny", *SMALL, "--batches", "2,65"])
    assert exit_info.value.code == 2
    assert "--batches: each value must be an integer [1, 64], got '65'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "step", "--preset", "tiny", *SMALL, "--batch-k", "-1"])
    assert exit_info.value.code == 2
    assert "--batch-k: must be in [0, " in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # was accepted: 0 or negative tokens/s columns
        main(["bench", "step", "--preset", "tiny", *SMALL, "--tpf", "-1"])
    assert exit_info.value.code == 2 and "--tpf: must be > 0, got -1.0" in capsys.readouterr().err


def test_bench_step_refuses_flags_it_would_ignore(capsys: pytest.CaptureFixture[str]) -> None:
    # Were accepted and ignored: no adapter merged into a preset (yet named in the setup JSON), no
    # autotuning without --gemm.
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "step", "--preset", "tiny", *SMALL, "--adapter", "/some/lora"])
    assert exit_info.value.code == 2 and "--adapter: needs --model" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "step", "--preset", "tiny", *SMALL, "--gemm-autotune"])
    assert exit_info.value.code == 2 and "--gemm-autotune: needs --gemm" in capsys.readouterr().err


def test_bench_step_refuses_caches_longer_than_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    # Were a ValueError traceback from the window model (the bundled model's default grid included).
    from lopa.engine import bundled_model_dir

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "step", "--model", str(bundled_model_dir()), *SMALL])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--caches: the longest cache + window + 64 is 2240 positions, the model holds 256" in err
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "step", "--preset", "tiny", *SMALL, "--caches", "0", "--step-cache", "1000"])
    assert exit_info.value.code == 2 and "--step-cache: the longest cache" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "step", "--preset", "tiny", *SMALL, "--step-cache", "-1"])
    assert exit_info.value.code == 2 and "--step-cache: must be >= 0, got -1" in capsys.readouterr().err


def test_write_checkpoint_is_sharded_and_loads_with_its_adapter(tmp_path: Path) -> None:
    model_dir, adapter_dir = tmp_path / "model", tmp_path / "lora"
    args = ["bench", "write-checkpoint", "--preset", "tiny", "--out", str(model_dir), "--adapter-out",
            str(adapter_dir), "--lora-rank", "4", "--dtype", "float32", "--shard-gb", "0.00005"]
    assert main(args) == 0
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shards = sorted({*index["weight_map"].values()})
    assert len(shards) > 1 and all(name.endswith(f"-of-{len(shards):05d}.safetensors") for name in shards)
    assert all((model_dir / name).is_file() for name in shards)
    plain = load_model(model_dir)
    merged = load_model(model_dir, adapter_dir)
    delta = lora_delta(read_adapter(adapter_dir))
    name = "model.layers.0.mlp.down_proj"
    got = merged.model.state_dict()[f"{name}.weight"] - plain.model.state_dict()[f"{name}.weight"]
    torch.testing.assert_close(got, delta[name], rtol=1e-4, atol=1e-5)


def test_round_rows_say_whether_the_rounds_replayed_a_graph() -> None:
    # The uncaptured graph path (WindowGraphs(capture=False)) stands in for CUDA's: the column
    # tells a GPU run whether its batched rounds replayed or fell back to eager forwards.
    from lopa.engine import bundled_model_dir
    from lopa.model.cuda_graphs import WindowGraphs
    from lopa_bench.cli.step import _replayed
    from lopa_bench.step import StepBench

    loaded = load_model(bundled_model_dir())
    bench = StepBench(loaded.model, 64, loaded.special.mask, repeat=1, graphs=False, sequences=2)
    bench.fill_cache(8, 2)
    assert not _replayed(bench, 2)  # no graphs at all
    window = bench.window
    graphs = window.graphs = WindowGraphs(loaded.model, window._physical, window.kv_storage, capture=False)
    bench.round_ms(2, 2, 16, 4)
    assert _replayed(bench, 2) and not _replayed(bench, 1)
    graphs.capture_tokens = 0  # LOPA_CUDA_GRAPH_TOKENS=0: the same buckets now run eagerly
    assert not _replayed(bench, 2)
    graphs.capture_tokens = None
    graphs.batched_disabled = True
    assert not _replayed(bench, 2)


def test_bench_step_checks_its_json_directory_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Written when every table is done: a missing directory was an OSError after the whole run.
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "step", "--preset", "tiny", *SMALL, "--json", str(tmp_path / "missing" / "step.json")])
    assert exit_info.value.code == 2 and "--json: no directory" in capsys.readouterr().err
