"""`lopa bench ablation` and `lopa bench orders`, run tiny: each writes a well-formed table, JSON and
PNG, and the steering behind each check does what its report claims."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lopa.bundled import bundled_model_dir, tasks
from lopa.cli import main
from lopa.model.decoding_defaults import model_defaults
from lopa_bench import ablation, orders
from lopa_bench.single import SingleModel


def png(path: Path) -> bytes:
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 1000
    return data


def test_bench_ablation_writes_one_row_per_k_and_winner_choice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "ablation", "--limit", "2", "--ks", "0,2", "--out", str(tmp_path)]) == 0
    assert "| k | winner |" in capsys.readouterr().out.replace("| attention ", "")
    report = json.loads((tmp_path / "ablation.json").read_text())
    assert [(r["k"], r["winner"]) for r in report["rows"]] == [
        (k, c) for k in (0, 2) for c in ablation.CHOICES
    ]
    k0 = [r for r in report["rows"] if r["k"] == 0]
    assert len({r["tpf"] for r in k0}) == 1  # one candidate: every choice is the anchor
    anchor = next(r for r in report["rows"] if r["k"] == 2 and r["winner"] == "anchor")
    assert anchor["tpf"] == k0[0]["tpf"]  # the anchor always winning decodes as D2F
    assert anchor["verified_per_token"] > k0[0]["verified_per_token"]  # ... paying for 3 rows
    assert report["params"]["block_size"] == model_defaults(bundled_model_dir()).block_size
    png(tmp_path / "ablation.png")


def test_bench_orders_marks_every_order_of_every_prompt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["bench", "orders", "--limit", "2", "--orders", "3", "--k", "2", "--out", str(tmp_path)]
    assert main(args) == 0
    assert "lopa_order" in capsys.readouterr().out
    report = json.loads((tmp_path / "orders.json").read_text())
    assert len(report["rows"]) == 2 and report["summary"]["lopa"] > 0
    for row in report["rows"]:
        assert len(row["_random"]) == 3
        assert row["random_worst"] <= row["random_median"] <= row["random_best"]
        assert 0 <= row["lopa_order_percentile"] <= 100
    png(tmp_path / "orders.png")


def test_d2f_order_replayed_is_d2f() -> None:
    """Following Conf as the order must reproduce D2F: the steering changes nothing else."""
    model = SingleModel.load(bundled_model_dir())
    params = model_defaults(bundled_model_dir()).with_overrides(branches=0)
    example = tasks.held_out(1)[0]
    prompt = model.encode(example.prompt)
    plain = model.generate(prompt, params)
    rank, _ = orders.lopa_order(model, prompt, params)  # k = 0: the order D2F filled in
    replayed = model.generate(prompt, params, lambda inner: orders.Ordered(inner, rank))
    assert replayed.output_ids == plain.output_ids and replayed.forwards == plain.forwards


@pytest.mark.parametrize("bad", [["--orders", "0"], ["--k", "0"], ["--limit", "0"]])
def test_bench_orders_refuses_bad_counts(tmp_path: Path, bad: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "orders", "--out", str(tmp_path), *bad])
    assert exit_info.value.code == 2


def test_bench_options_writes_each_score_and_policy_for_each_k(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lopa_bench import options

    assert main(["bench", "options", "--limit", "2", "--ks", "2", "--out", str(tmp_path)]) == 0
    assert "| score | k |" in capsys.readouterr().out
    report = json.loads((tmp_path / "options.json").read_text())
    assert [r["score"] for r in report["branch_score"]] == [label for label, _ in options.SCORES]
    assert [r["policy"] for r in report["branch_policy"]] == [label for label, _ in options.POLICIES]
    paper, _, _, _, _ = report["branch_score"]
    assert report["branch_policy"][0]["tpf"] == paper["tpf"]  # both are the paper's rules
    for row in report["branch_score"] + report["branch_policy"]:
        assert row["k"] == 2 and 0 < row["lookaheads_per_round"] <= 2 and row["tpf"] > 0
    png(tmp_path / "options.png")
