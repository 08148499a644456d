"""`lopa bench commit` (lopa_bench.commit_cost) end to end: real master and worker processes, gloo.

It checks the report is well formed (every phase measured, the commit's bytes those of the
model's K/V), never how fast anything is: timings belong in runtime/BENCHMARKS.md.
"""

from __future__ import annotations

import json
from pathlib import Path

from .test_benches import run_lopa


def test_bench_commit_reports_the_phases_of_a_round_per_worker_count(tmp_path: Path) -> None:
    done = run_lopa("bench", "commit", "--workers", "1,2", "--requests", "2", "--branches", "2",
                    "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| workers | k |" in done.stdout
    report = json.loads((tmp_path / "commit.json").read_text())
    rows = report["rows"]
    assert [r["workers"] for r in rows] == [1, 2]
    for row in rows:
        assert row["k"] == 2 and row["forward_ms"] > 0 and row["commit_ms"] >= 0
        assert 0 < row["prewrite_ms"] < row["forward_ms"]  # the staging copies are part of the forward
        assert row["commit_kb"] > 0  # the bundled model caches whole blocks: some rounds commit
    assert rows[1]["prewrite_ms"] <= rows[0]["prewrite_ms"]  # two workers share a round's rows
    png = (tmp_path / "commit.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000


def test_bench_commit_checks_its_flags_before_starting_a_group(tmp_path: Path) -> None:
    done = run_lopa("bench", "commit", "--workers", "1,0", "--out", str(tmp_path), timeout=60)
    assert done.returncode == 2 and "--workers: every worker count must be >= 1" in done.stderr
