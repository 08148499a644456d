"""`lopa bench serving`, `concurrency` and `transport` (lopa_bench): end to end with real processes,
real gRPC and gloo, plus the serving bench's workload.

They check what the benches report is well formed and consistent (phases add up, every row has
a measurement), never how fast anything is: timings belong in runtime/BENCHMARKS.md.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lopa.cli import main

from .conftest import worker_env

pytestmark = pytest.mark.slow  # one of the longest files: a parallel run starts it first


def run_lopa(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "lopa", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=worker_env())


def lopa_refuses(*args: str) -> subprocess.CompletedProcess:
    """`lopa args...` run in this process, for the calls a check refuses before any model, group or
    bench starts: the same exit code and messages without a process (and its torch import) each."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exited:
            code = exited.code
    return subprocess.CompletedProcess(["lopa", *args], code, out.getvalue(), err.getvalue())


def test_bench_serving_reports_the_step_split_and_the_concurrency_sweep(
    tmp_path: Path, checkpoint: Path
) -> None:
    out = tmp_path / "serving.json"
    done = run_lopa(
        "bench", "serving", "--model", str(checkpoint), "--workers", "1,2", "--requests", "4",
        "--concurrency", "1,4", "--branches", "2", "--block-size", "8", "--max-new-tokens", "16",
        "--json", str(out),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    splits, sweep = report["step_split"], report["concurrency"]
    assert [r["workers"] for r in splits] == [1, 2]
    assert "| workers | concurrency |" in done.stdout  # the tables after the per-row JSON lines
    assert "group of 1 formed in" in done.stdout and "group of 2 formed in" in done.stdout  # progress
    for row in splits:
        assert row["forward_ms"] > 0 and row["coordination_ms"] >= 0 and row["commit_ms"] >= 0
        # the phases are parts of the master's step; step_ms also holds its decoding rules
        phases = row["forward_ms"] + row["coordination_ms"] + row["commit_ms"]
        assert phases <= row["step_ms"] * 1.05
        assert abs(row["overhead_ms"] - row["coordination_ms"] - row["commit_ms"]) < 0.01
        assert row["tpf"] >= 1
    assert [(r["workers"], r["concurrency"]) for r in sweep] == [(1, 1), (1, 4), (2, 1), (2, 4)]
    for row in sweep:
        assert row["requests"] == 4 and row["tokens"] > 0 and row["tok_s"] > 0 and row["tpf"] >= 1
        assert 0 < row["p50_s"] <= row["p99_s"] and 0 <= row["mean_branches"] <= 2
        assert row["work_per_token"] > 1 and row["us_per_verified"] > 0  # prefill rows count too
    assert sweep[0]["speedup"] == sweep[2]["speedup"] == 1.0
    assert sweep[0]["p99_slowdown"] == 1.0 and sweep[1]["p99_slowdown"] > 0
    assert not any(key.startswith("_") for row in sweep for key in row)  # no working keys written


def test_bench_serving_rejects_bad_levels() -> None:
    done = lopa_refuses("bench", "serving", "--concurrency", "1,0")
    assert done.returncode == 2 and "--concurrency: every level must be >= 1" in done.stderr


def test_bench_serving_checks_its_worker_counts_before_starting_any_group() -> None:
    # Parsed up front: "x" was a ValueError traceback, and "1,0" a RuntimeError after the
    # 1-worker group had run its whole sweep.
    done = lopa_refuses("bench", "serving", "--workers", "1,x")
    assert done.returncode == 2 and "--workers: not a comma-separated list of integers: '1,x'" in done.stderr
    done = lopa_refuses("bench", "serving", "--workers", "1,0")
    assert done.returncode == 2 and "--workers: every worker count must be >= 1, got '1,0'" in done.stderr
    assert "concurrency" not in done.stdout  # no group ran


def test_bench_serving_takes_a_model_or_synthetic_not_both() -> None:
    # --synthetic benchmarked its random model in place of --model's checkpoint, saying nothing.
    done = lopa_refuses("bench", "serving", "--model", "/some/checkpoint", "--synthetic")
    assert done.returncode == 2 and "argument --synthetic: not allowed with argument --model" in done.stderr


def test_bench_serving_refuses_a_max_batch_below_one() -> None:
    # 0 was taken as "unset": the bench ran with the default max_batch instead.
    done = lopa_refuses("bench", "serving", "--workers", "1", "--requests", "1", "--concurrency", "1",
                    "--max-new-tokens", "16", "--max-batch", "0")
    assert done.returncode == 2 and "--max-batch: must be >= 1, got 0" in done.stderr


def test_bench_serving_serves_the_branches_it_asks_above_the_default_server_limit(
    tmp_path: Path, checkpoint: Path
) -> None:
    # The bench's own group: k = 16 is over limits.max_branches' default (15), not MAX_BRANCHES,
    # and was refused by it (a gRPC INVALID_ARGUMENT traceback).
    out = tmp_path / "serving.json"
    done = run_lopa("bench", "serving", "--model", str(checkpoint), "--workers", "1", "--requests", "1",
                    "--concurrency", "1", "--branches", "16", "--block-size", "8", "--max-new-tokens", "16",
                    "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(out.read_text())["concurrency"][0]["tokens"] > 0
    done = lopa_refuses("bench", "serving", "--branches", "65")
    assert done.returncode == 2 and "--branches: must be in [0, 64], got 65" in done.stderr


def test_bench_serving_names_the_flag_its_group_refuses(checkpoint: Path) -> None:
    # More new tokens than the model holds: the server's INVALID_ARGUMENT is one line naming the
    # flag, not a gRPC traceback.
    done = run_lopa("bench", "serving", "--model", str(checkpoint), "--workers", "1", "--requests", "1",
                    "--concurrency", "1", "--max-new-tokens", "5000")
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip() == "lopa bench: error: --max-new-tokens: 5000 exceeds the server limit 512"


def test_bench_concurrency_sweeps_the_local_engine(tmp_path: Path) -> None:
    out = tmp_path / "concurrency.json"
    done = run_lopa("bench", "concurrency", "--levels", "1,3", "--requests", "3", "--branches", "1",
                    "--passes", "2", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["concurrency"] for r in rows] == [1, 3] and "| concurrency |" in done.stdout
    assert done.stdout.count('"pass": ') == 4  # each pass's rows as they are measured, then the medians
    for row in rows:
        assert row["requests"] == 3 and row["tokens"] > 0 and row["tpf"] >= 1 and row["passes"] == 2
        assert 0 <= row["mean_branches"] <= 1 and 0 < row["p50_s"] <= row["p99_s"]
        assert row["p99_slowdown"] > 0 and "_latencies" not in row
        assert row["work_per_token"] > 1 and row["us_per_verified"] > 0
    assert rows[0]["p99_slowdown"] == 1.0
    done = lopa_refuses("bench", "concurrency", "--levels", "x")
    assert done.returncode == 2 and "--levels: not a comma-separated list of integers: 'x'" in done.stderr
    # 8 in flight out of 4 requests: the row said concurrency 8 for a level that ran 4 at once.
    done = lopa_refuses("bench", "concurrency", "--levels", "1,8", "--requests", "4")
    assert done.returncode == 2 and "--levels: 8 in flight needs --requests >= 8, got 4" in done.stderr
    done = lopa_refuses("bench", "concurrency", "--passes", "0")
    assert done.returncode == 2 and "--passes: must be >= 1, got 0" in done.stderr
    done = lopa_refuses("bench", "concurrency", "--device", "tpu")
    assert done.returncode == 2 and "--device:" in done.stderr and "tpu" in done.stderr
    done = lopa_refuses("bench", "concurrency", "--device", "cpu", "--profile", str(tmp_path))
    assert done.returncode == 2
    assert "--profile: needs --device cuda (the kernels' table), got cpu" in done.stderr


def test_bench_transport_measures_both_transports(tmp_path: Path) -> None:
    out = tmp_path / "transport.json"
    args = ["--rounds", "10", "--busy-ms", "0,2", "--json", str(out)]
    done = run_lopa("bench", "transport", *args, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["transport"], r["busy_ms"]) for r in rows] == [
        ("socket", 0.0), ("grpc", 0.0), ("socket", 2.0), ("grpc", 2.0)
    ]
    for row in rows:  # a round trip always costs something beyond the peer's own work
        assert 0 < row["median_ms"] <= row["p90_ms"] and row["rounds"] == 10


def test_bench_transport_rejects_bad_flags() -> None:
    done = lopa_refuses("bench", "transport", "--busy-ms", "1,x")
    assert done.returncode == 2 and "--busy-ms: not a comma-separated list of numbers" in done.stderr
    done = lopa_refuses("bench", "transport", "--rounds", "0")
    assert done.returncode == 2 and "--rounds: must be >= 1" in done.stderr


def test_the_row_benches_check_their_json_directory_before_running(tmp_path: Path) -> None:
    # The rows are written when the run ends: a missing directory was an OSError after the whole run.
    path = str(tmp_path / "missing" / "rows.json")
    for bench in (["transport", "--rounds", "1", "--busy-ms", "0"],
                  ["concurrency", "--levels", "1", "--requests", "1"],
                  ["serving", "--workers", "1", "--concurrency", "1", "--requests", "1"]):
        done = lopa_refuses("bench", *bench, "--json", path)
        assert done.returncode == 2 and f"--json: no directory '{tmp_path / 'missing'}'" in done.stderr, bench


def test_bench_serving_runs_on_the_bundled_model_by_default(tmp_path: Path) -> None:
    """Its served defaults are the model's own: the paper's 256 new tokens would not fit it."""
    out = tmp_path / "serving.json"
    done = run_lopa("bench", "serving", "--workers", "1", "--requests", "2", "--concurrency", "1,2",
                    "--max-new-tokens", "16", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    sweep = json.loads(out.read_text())["concurrency"]
    assert [r["concurrency"] for r in sweep] == [1, 2] and all(r["tpf"] >= 1 for r in sweep)


def test_bench_serving_uses_held_out_prompts_and_model_defaults_on_the_bundled_model() -> None:
    import argparse

    from lopa.bundled import tasks
    from lopa.model.decoding_defaults import model_defaults
    from lopa.proto import lopa_pb2
    from lopa.serving.shared.model_dir import model_path
    from lopa_bench import serving as bench

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


def test_bench_samples_compares_n_samples_with_separate_requests(tmp_path: Path) -> None:
    """One request with n samples and n separate requests of the same seeds answer alike; the rows
    carry each variant's time and the ratio."""
    out = tmp_path / "samples.json"
    done = run_lopa("bench", "samples", "--n", "3", "--passes", "1", "--workers", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["variant"] for r in rows] == ["one request, n=3", "3 requests, n=1"]
    assert all(r["same_answers"] and r["seconds"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert rows[1]["x_separate"] == 1.0 and rows[0]["x_separate"] > 0
    refused = lopa_refuses("bench", "samples", "--n", "0")
    assert refused.returncode == 2 and "--n: must be >= 1" in refused.stderr
    refused = lopa_refuses("bench", "samples", "--prompt-tokens", "300")
    assert refused.returncode == 2 and "--prompt-tokens: must be in [0, 224]" in refused.stderr


def test_bench_shared_prompt_times_the_first_round_of_one_prompt_and_different_ones(tmp_path: Path) -> None:
    out = tmp_path / "shared.json"
    done = run_lopa("bench", "shared-prompt", "--n", "2", "--passes", "1", "--prompt-tokens", "40",
                    "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["variant"] for r in rows] == ["2 requests, one prompt", "2 requests, different prompts"]
    assert all(r["first_round_ms"] > 0 and r["later_round_ms"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert rows[1]["x_different"] == 1.0
    refused = lopa_refuses("bench", "shared-prompt", "--prompt-tokens", "0")
    assert refused.returncode == 2 and "--prompt-tokens: must be in [1, 224]" in refused.stderr
