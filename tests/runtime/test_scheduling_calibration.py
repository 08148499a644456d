"""The measured branch budget of an accelerator (lopa.scheduling.calibration), run on the CPU: the
rule, the measurement over a real window model, and what a group runs (the smallest of its workers')."""

from __future__ import annotations

import logging

import pytest

from lopa.engine import bundled_model_dir
from lopa.model.loader import load_model
from lopa.scheduling.budget import Budget, configured_budget, default_budget, joined_budget
from lopa.scheduling.calibration import MAX_ROWS, TOKENS, largest_within, measure_step_tokens, measured_tokens

# Rounds of a 7B-shaped model on an H100 (runtime/BENCHMARKS.md): compute-bound from ~256 tokens.
H100_7B = {128: 9.42, 256: 11.54, 512: 17.92, 1024: 33.42}


def test_the_budget_is_the_largest_forward_within_the_cost_factor_of_the_smallest() -> None:
    assert largest_within(H100_7B) == 512  # the fixed default, which beat 2048 in the sweep
    assert largest_within(H100_7B, factor=4.0) == 1024
    assert largest_within(H100_7B, factor=1.5) == 256
    assert largest_within({tokens: 3.0 + tokens / 1e4 for tokens in TOKENS}) == 1024  # launch-bound
    with pytest.raises(ValueError, match="no forward times"):
        largest_within({})


def test_measuring_times_every_size_and_leaves_the_cache_empty(caplog: pytest.LogCaptureFixture) -> None:
    window = load_model(bundled_model_dir()).window_model(256, max_batch=2)
    tokens, times = measure_step_tokens(window)
    assert sorted(times) == list(TOKENS) and all(ms > 0 for ms in times.values())
    assert tokens == largest_within(times) and window.cache_length(0) == 0
    assert window.forwards == {"graph": 0, "eager": 0}  # the worker's counters count requests only
    assert measured_tokens(window, "cpu") is None  # a CPU's default is a share of the rows
    with caplog.at_level(logging.INFO, logger="lopa.execution"):
        # What an accelerator runs, timed on this CPU: the value and its times are logged.
        measured = measured_tokens(window, "cuda")
    assert measured in TOKENS and f"branch budget on cuda: {measured} tokens per forward" in caplog.text


def test_short_windows_time_whole_rows_within_the_reserved_staging() -> None:
    window = load_model(bundled_model_dir()).window_model(48)
    _, times = measure_step_tokens(window)
    assert sorted(times) == [96, 240, 480]  # rows of 48; 1024 would take 21 rows: left out
    assert window.kv.num_slots <= MAX_ROWS


def test_a_device_fault_while_measuring_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    window = load_model(bundled_model_dir()).window_model(96)

    def illegal_access(*args: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(window, "forward", illegal_access)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        measured_tokens(window, "cuda")


def test_a_failed_measurement_keeps_the_fixed_default(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    window = load_model(bundled_model_dir()).window_model(96)

    def out_of_memory(*args: object) -> None:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(window, "forward", out_of_memory)
    with caplog.at_level(logging.WARNING, logger="lopa.execution"):
        assert measured_tokens(window, "cuda:0") is None
    assert "could not measure the branch budget on cuda:0 (CUDA out of memory" in caplog.text


def test_a_group_runs_the_smallest_budget_its_workers_measured() -> None:
    assert joined_budget(0, [1024, 512], "cuda") == Budget(512)
    assert joined_budget(640, [1024, 512], "cuda") is None  # limits.max_step_tokens set: it stands
    # One did not measure: the fixed default, not the budget of an earlier group.
    assert joined_budget(0, [1024, 0], "cuda:1") == default_budget("cuda") == Budget(512)
    assert joined_budget(0, [0, 0], "cpu") is None  # CPU workers measure nothing: its default stays
    # model.device auto: the joined workers' device decides, a CPU's default too
    assert joined_budget(0, [0, 0], "cpu", device_auto=True) == default_budget("cpu")
    assert joined_budget(640, [0, 0], "cpu", device_auto=True) is None
    # Where every scheduler starts: the configured count, else the device's default.
    assert configured_budget(640, "cuda") == Budget(640)
    assert configured_budget(0, "cpu") == default_budget("cpu")
