"""`lopa bench stream-cost` run small on the CPU: the whole answer streams through the master's path
and the table is consistent, never how fast anything is (the figures: runtime/BENCHMARKS.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lopa.cli import main
from lopa_bench.stream_cost import TimedExecutor, master_times, summary


def test_bench_stream_cost_streams_the_whole_answer_and_compares_its_ends(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "stream.json"
    args = ["bench", "stream-cost", "--tokens", "160", "--branches", "1", "--block-size", "16"]
    assert main([*args, "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["tokens"] == 160 and row["tokens_streamed"] == 160  # end tokens excluded: never short
    assert row["rounds"] >= 160 // 16
    assert row["start_us_per_round"] > 0 and row["end_us_per_round"] > 0
    assert row["end_vs_start"] == pytest.approx(row["end_us_per_round"] / row["start_us_per_round"], abs=0.02)
    first, last = (int(span.split("..")[0]) for span in (row["start_positions"], row["end_positions"]))
    assert first < 16 <= last  # the start's windows open the answer, the end's are past its first block
    assert "| tokens | rounds |" in capsys.readouterr().out


def test_the_master_time_of_a_round_leaves_out_the_executor_calls_in_it() -> None:
    # verifies: (start, end, window start); between: the other executor calls' time after each
    recorded = TimedExecutor(None, [(0.0, 1.0, 10), (1.5, 2.5, 14), (3.25, 4.0, 20)], [0.25, 0.5, 0.0])
    rounds = master_times(recorded, prompt_length=10)
    assert rounds == [(0, 0.25), (4, 0.25)]  # 1.5 - 1.0 - 0.25 and 3.25 - 2.5 - 0.5
    row = summary([(i, 2e-6 * i) for i in range(1, 21)], tokens=20)  # medians of the first and last tenth
    assert (row["start_us_per_round"], row["end_us_per_round"], row["end_vs_start"]) == (3, 39, 13.0)
    assert (row["start_positions"], row["end_positions"], row["rounds"]) == ("1..2", "19..20", 21)


@pytest.mark.parametrize("flag", ["--tokens", "--block-size"])
def test_bench_stream_cost_refuses_a_length_below_one(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "stream-cost", flag, "0"])
    assert exit_.value.code == 2
    assert f"{flag}: must be >= 1, got 0" in capsys.readouterr().err
