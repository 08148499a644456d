"""lopa_bench.concurrency: the sweep's bookkeeping (closed loop, ratios within a pass, medians over
interleaved passes), driven by a Send that answers from a table instead of a model."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from lopa_bench.cli.concurrency import write_profile
from lopa_bench.concurrency import Answer, combine, run_level, sweep, with_ratios
from lopa_bench.profiling import profiled
from lopa_bench.rows import markdown_table, percentile


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)


def test_ratios_are_taken_against_the_first_level() -> None:
    rows = with_ratios([{"tok_s": 100.0, "p50_s": 0.5, "p99_s": 0.6}])
    rows.append({"tok_s": 250.0, "p50_s": 1.0, "p99_s": 1.5})
    with_ratios(rows)
    assert rows[0]["speedup"] == 1.0 and rows[1]["speedup"] == 2.5 and rows[1]["p99_x_lone"] == 3.0


def test_the_slowdown_compares_each_request_with_itself_alone() -> None:
    # Request 0 is short and request 1 long: under load both take twice their own lone latency,
    # though the long one's latency is 8x the short one's alone.
    rows = with_ratios([{"tok_s": 10.0, "p50_s": 0.1, "p99_s": 0.4, "_latencies": [0.05, 0.4]}])
    rows.append({"tok_s": 20.0, "p50_s": 0.4, "p99_s": 0.8, "_latencies": [0.1, 0.8]})
    with_ratios(rows)
    assert rows[0]["p99_slowdown"] == 1.0 and rows[1]["p99_slowdown"] == 2.0
    assert rows[1]["p99_x_lone"] == 8.0  # against the lone median: the spread counts too
    assert all(not key.startswith("_") for key in combine([rows, rows])[1])
    assert "_latencies" not in markdown_table(rows) and "p99_slowdown" in markdown_table(rows)


def _row(level: int, tok_s: float, p99: float, speedup: float) -> dict:
    return {"concurrency": level, "requests": 4, "tok_s": tok_s, "p99_s": p99, "speedup": speedup}


def test_combine_takes_each_quantity_s_median_and_the_speedup_range() -> None:
    runs = [
        [_row(1, 100.0, 0.2, 1.0), _row(8, 150.0, 1.0, 1.5)],
        [_row(1, 50.0, 0.4, 1.0), _row(8, 110.0, 1.2, 2.2)],  # a slow moment of the host
        [_row(1, 90.0, 0.25, 1.0), _row(8, 190.0, 0.9, 2.1)],
    ]
    lone, eight = combine(runs)
    assert lone["tok_s"] == 90.0 and lone["speedup"] == 1.0 and lone["passes"] == 3
    # Medians of each column separately: the speedup is the median of the per-pass ratios (2.1),
    # not the ratio of the medians (150 / 90).
    assert (eight["tok_s"], eight["p99_s"], eight["speedup"]) == (150.0, 1.0, 2.1)
    assert eight["speedup_range"] == "1.50-2.20" and eight["requests"] == 4
    assert combine([runs[0]]) == runs[0]  # one pass: as measured
    with pytest.raises(ValueError, match="same levels"):
        combine([runs[0], runs[1][:1]])


def test_mean_branches_is_per_round_over_every_requests_rounds() -> None:
    """A long request's rounds weigh as many as they are: 3 rounds at 0 and 1 round at 4 average 1,
    not (0 + 4) / 2."""
    answers = [Answer(tokens=6, forwards=3, mean_branches=0.0, verified_tokens=30),
               Answer(tokens=8, forwards=1, mean_branches=4.0, verified_tokens=50)]
    row = run_level(lambda index: answers[index], requests=2, concurrency=1)
    assert row["mean_branches"] == 1.0 and row["tpf"] == 3.5


def test_sweep_interleaves_its_passes_and_keeps_each_level_in_flight() -> None:
    lock, in_flight, order = threading.Lock(), [0], []
    peaks = [0, 0, 0, 0]  # most requests in flight during each (pass, level) run, in run order

    def send(index: int) -> Answer:
        with lock:
            in_flight[0] += 1
            run = len(order)  # a row is shown when its level ends: the running one is the next
            peaks[run] = max(peaks[run], in_flight[0])
        threading.Event().wait(0.01)
        with lock:
            in_flight[0] -= 1
        return Answer(tokens=10, forwards=2, mean_branches=1.0, verified_tokens=40)

    def show(row: dict) -> None:
        order.append((row["pass"], row["concurrency"]))

    rows = sweep(send, requests=8, levels=(1, 4), warmup=0, show=show, passes=2)
    assert order == [(1, 1), (1, 4), (2, 1), (2, 4)]  # interleaved: 1, 4, 1, 4
    assert peaks[0] == peaks[2] == 1 and 2 <= peaks[1] <= 4 and 2 <= peaks[3] <= 4  # closed loop
    assert [r["concurrency"] for r in rows] == [1, 4] and all(r["passes"] == 2 for r in rows)
    assert all(r["tokens"] == 80 and r["tpf"] == 5.0 and r["work_per_token"] == 4.0 for r in rows)
    # 320 verified tokens per level: the wall time per verified token (a median over passes, so it
    # is checked per level against the median wall time within rounding, not recomputed exactly)
    assert all(r["us_per_verified"] == pytest.approx(r["wall_s"] * 1e6 / 320, rel=0.05) for r in rows)


def test_a_level_counts_the_graph_captures_its_rounds_paid() -> None:
    captured, lock = [(4, 0.5)], threading.Lock()  # the engine's start and warm-up captured before

    def send(index: int) -> Answer:
        with lock:  # each request's rounds need a new shape
            count, seconds = captured[0]
            captured[0] = (count + 1, seconds + 0.25)
        threading.Event().wait(0.005)  # a latency the ratios can divide by
        return Answer(tokens=10, forwards=2, mean_branches=1.0, verified_tokens=40)

    rows = sweep(send, requests=3, levels=(1, 2), warmup=0, captures=lambda: captured[0])
    assert [(r["captures"], r["capture_s"]) for r in rows] == [(3, 0.75), (3, 0.75)]
    assert "captures" not in sweep(send, requests=3, levels=(1,), warmup=0)[0]  # no graphs: no column


def test_a_profile_tables_the_ops_it_ran_and_the_device_time_on_an_accelerator() -> None:
    x = torch.ones(64, 64)
    profile = profiled(lambda: [x @ x for _ in range(3)], torch.device("cpu"))
    assert "aten::mm" in profile.table and profile.wall_s > 0
    assert "[64, 64]" in profile.ops_table  # the ops with their input shapes
    assert profile.device_s is None and profile.device_busy is None  # no kernels on a CPU


def test_the_concurrency_profile_reruns_the_level_and_writes_its_summary(tmp_path: Path) -> None:
    sent: list[int] = []

    def send(index: int) -> Answer:
        sent.append(index)
        return Answer(tokens=10, forwards=2, mean_branches=1.0, verified_tokens=40)

    path = write_profile(send, requests=3, level=2, device=torch.device("cpu"), out=tmp_path / "p")
    assert sorted(sent) == [0, 1, 2] and path == tmp_path / "p" / "concurrency_profile.txt"
    summary = path.read_text().splitlines()[0]
    assert summary.startswith("2 in flight, 3 requests, after the sweep: ") and "TPF 5.0" in summary
    assert "device busy" not in summary  # a CPU has no kernel time to compare with the wall's
