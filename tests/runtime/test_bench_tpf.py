"""`lopa bench tpf --limit 2`: the sweep runs end to end and writes its table, JSON and PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lopa.cli import main
from lopa_bench.tpf import KS, MODES


def test_bench_tpf_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "tpf", "--limit", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "TPF" in out and "tok/s" in out and "best k=" in out
    report = json.loads((tmp_path / "tpf.json").read_text())
    cells = {(c["attention"], c["branches"]) for c in report["cells"]}
    assert cells == {(m, k) for m in MODES for k in KS}
    for cell in report["cells"]:
        assert cell["examples"] == 2 and cell["forwards"] > 0
        for key in ("exact_match", "tpf", "padded_tpf", "tokens_per_s", "step_ms"):
            assert cell[key] >= 0
    assert set(report["speedups"]) == set(MODES)
    png = (tmp_path / "tpf.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000


def test_bench_tpf_checks_its_out_directory_before_the_sweep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A file where the directory goes: the sweep ran first, then failed with its table unprinted.
    taken = tmp_path / "file"
    taken.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "tpf", "--limit", "1", "--ks", "0", "--modes", "full", "--out", str(taken)])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "File exists" in err and "k=0" not in err  # no cell was decoded
