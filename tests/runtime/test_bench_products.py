"""`lopa bench products`, `lopa bench weights` and `lopa bench step --weights fp8` end to end on
the CPU with tiny settings: the tables are well formed and consistent, never how fast anything is
(GPU figures: tools/gpu-checks.sh, runtime/BENCHMARKS.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lopa.cli import main
from lopa.kernels.fp8_products import TABLE_ENV, Choice, parse_table
from lopa.synthetic.checkpoint import PRESETS
from lopa_bench.products import DTYPE, SCALED_MM, TRITON, Shape, step_shapes, suggested_table


def test_bench_products_times_each_shape_and_sums_a_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "products.json"
    args = ["bench", "products", "--preset", "tiny", "--device", "cpu", "--dtype", "bfloat16", "--tokens",
            "8,32", "--kernels", "dtype,triton,scaled_mm,dequant", "--repeat", "2", "--json", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    rows, shapes = report["rows"], step_shapes(PRESETS["tiny"]())
    products = [r for r in rows if r["kind"] == "product"]
    assert [(r["weight"], r["tokens"]) for r in products] == [(s.name, n) for s in shapes for n in (8, 32)]
    for row in products:
        assert row["dtype_ms"] > 0 and row["scaled_mm_ms"] > 0 and row["dequant_ms"] > 0
        assert row["triton_ms"] is None  # needs CUDA
        assert row["scaled_mm_x_dtype"] == pytest.approx(row["scaled_mm_ms"] / row["dtype_ms"], rel=0.02)
    steps = [r for r in rows if r["kind"] == "step"]
    assert [r["tokens"] for r in steps] == [8, 32]
    for row in steps:
        mine = [r for r in products if r["tokens"] == row["tokens"]]
        per_step = {s.name: s.per_step for s in shapes}
        want = sum(r["dtype_ms"] * per_step[r["weight"]] for r in mine)
        assert row["dtype_ms"] == pytest.approx(want, rel=0.01)
        assert row["triton_ms"] is None and row["best_fp8_ms"] == row["scaled_mm_ms"]
    # The suggested table is one the runtime reads (LOPA_FP8_PRODUCTS=the JSON file).
    table = parse_table(report["choices"], "choices")
    assert table[-1] == Choice(SCALED_MM)
    printed = capsys.readouterr().out
    assert "| weight | shape | tokens | dtype_ms |" in printed and "suggested choices" in printed
    monkeypatch.setenv(TABLE_ENV, str(out))
    from lopa.kernels.fp8_products import table as runtime_table

    assert runtime_table() == table


def test_the_suggested_table_keeps_the_dtype_where_fp8_never_wins() -> None:
    shapes = [Shape("o", 64, 64, 2), Shape("gate_up", 256, 64, 2)]
    measured = [
        {"weight": "o", "tokens": 32, "dtype_ms": 1.0, "triton_ms": 1.5, "scaled_mm_ms": 2.0},
        {"weight": "o", "tokens": 256, "dtype_ms": 1.2, "triton_ms": 1.4, "scaled_mm_ms": 1.3},
        {"weight": "gate_up", "tokens": 32, "dtype_ms": 2.0, "triton_ms": 1.1, "scaled_mm_ms": 1.6},
        {"weight": "gate_up", "tokens": 256, "dtype_ms": 2.5, "triton_ms": 1.9, "scaled_mm_ms": 1.2},
    ]
    table = suggested_table(measured, shapes, [DTYPE, TRITON, SCALED_MM])
    assert table == [Choice(DTYPE, 1 << 30, 64, 64), Choice(TRITON, 32, 256, 64),
                     Choice(SCALED_MM, 256, 256, 64), Choice(SCALED_MM)]


def test_bench_products_refuses_a_run_without_its_base(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "products", "--preset", "tiny", "--device", "cpu", "--kernels", "triton"])
    assert exit_info.value.code == 2 and "--kernels: must include dtype" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "products", "--preset", "tiny", "--device", "cpu", "--kernels", "dtype,cublas"])
    assert exit_info.value.code == 2 and "--kernels: each must be one of" in capsys.readouterr().err


def test_bench_weights_compares_fp8_with_the_dtype(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "weights.json"
    assert main(["bench", "weights", "--limit", "3", "--ks", "0,3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    logits = rows[0]
    assert logits["kind"] == "logits" and 0 < logits["relative_error"] < 0.1
    assert 0.5 <= logits["argmax_agreement"] <= 1.0
    decodes = rows[1:]
    assert [r["k"] for r in decodes] == [0, 3] and all(r["prompts"] == 3 for r in decodes)
    for row in decodes:
        assert 0 <= row["greedy_agreement"] <= 1 and row["fp8_tpf"] > 0
        points = 100 * (row["fp8_exact_match"] - row["dtype_exact_match"])
        assert row["exact_match_points"] == pytest.approx(points)
    assert "| k | prompts | dtype_exact_match |" in capsys.readouterr().out


def test_bench_step_runs_fp8_weights_and_says_so(tmp_path: Path) -> None:
    out = tmp_path / "step.json"
    args = ["bench", "step", "--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--repeat", "2",
            "--copy-gb", "0.01", "--rows", "1", "--widths", "8", "--caches", "0", "--ks", "0,1",
            "--step-widths", "8", "--step-cache", "16", "--batches", "1,2", "--json", str(out)]
    assert main([*args, "--weights", "fp8"]) == 0
    report = json.loads(out.read_text())
    setup = report["setup"]
    assert setup["weights"] == "fp8" and setup["layer_steps"] == "torch"
    fp8_bytes = setup["weight_GB"]
    assert main([*args, "--weights", "dtype"]) == 0
    dtype_bytes = json.loads(out.read_text())["setup"]["weight_GB"]
    assert fp8_bytes < 0.3 * dtype_bytes  # e4m3 against float32 weights: a quarter, plus the scales
    assert {r["kind"] for r in report["rows"]} == {"forward", "step", "round"}
