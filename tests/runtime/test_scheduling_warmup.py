"""The graph buckets captured at start (lopa.scheduling.warmup): the plan of likely rounds, and
rounds of those shapes replaying graphs the warm-up captured, with no capture of their own. Checked
on the CPU through the uncaptured graph path (WindowGraphs(capture=False) counts a bucket's first
round as its capture); a GPU's captures run in tests/runtime/test_cuda.py."""

from __future__ import annotations

import logging

import pytest
import torch

from lopa.engine import bundled_model_dir
from lopa.model import WindowedLM
from lopa.model.cuda_graphs import WindowGraphs
from lopa.model.loader import load_model
from lopa.model.protocol import WindowBatch
from lopa.params import AttentionMode, DecodingParams
from lopa.scheduling.warmup import RoundShape, plan, request_counts, warm_graphs

PARAMS = DecodingParams(block_size=8, branches=3)


def test_the_plan_holds_lone_and_batched_rounds_of_the_defaults() -> None:
    shapes = plan(PARAMS, max_batch=8, max_length=256, budget_tokens=None)
    assert request_counts(8) == [2, 3, 4, 6, 8]
    for width in (8, 16):
        for cache in (1, 257):
            lone = {s.rows for s in shapes if (s.requests, s.width, s.cache_length) == (1, width, cache)}
            assert lone == ({1, 2, 4} if cache == 1 else set())  # 257 + a window exceeds 256 positions
        assert {(s.requests, s.rows) for s in shapes if s.requests > 1 and s.width == width} == {
            (r, 4) for r in (2, 3, 4, 6, 8)}
    # Under a branch budget each request of a batched round gets the rows that fit.
    budgeted = plan(PARAMS, max_batch=8, max_length=4096, budget_tokens=128)
    rows = {s.requests: s.rows for s in budgeted if s.requests > 1 and s.width == 16 and s.cache_length == 1}
    assert rows == {2: 4, 3: 2, 4: 2, 6: 1, 8: 1}
    assert {s.cache_length for s in budgeted} == {1, 257}
    assert len(budgeted) == len(set(budgeted))


def _prefilled(window: WindowedLM, sequences: int) -> None:
    """One committed token in each sequence's cache (the first cache bucket)."""
    for sequence in range(sequences):
        batch = WindowBatch(torch.tensor([[5]]), [1], torch.zeros(1, 1, dtype=torch.long), 0, 1,
                            AttentionMode.FULL, outputs=(0,), sequence=sequence)
        window.forward(batch)
        window.commit(0, 1, sequence)


def _round(shape: RoundShape, sequence: int) -> WindowBatch:
    generator = torch.Generator().manual_seed(sequence)
    tokens = torch.randint(0, 90, (shape.rows, shape.width), generator=generator)
    blocks = torch.ones(shape.rows, shape.width, dtype=torch.long)
    outputs = tuple(range(0, shape.rows * shape.width, 3))
    return WindowBatch(tokens, [shape.width] * shape.rows, blocks, shape.cache_length, 1, AttentionMode.FULL,
                       outputs=outputs, sequence=sequence)


def test_rounds_of_the_plan_replay_graphs_captured_at_start() -> None:
    model = load_model(bundled_model_dir()).model
    window = WindowedLM(model, 128, max_batch=4)
    window.graphs = WindowGraphs(model, window._physical, window.kv_storage, capture=False)
    captured, _ = warm_graphs(window, PARAMS, budget_tokens=None)
    assert captured == window.graph_captures()[0] > 0
    _prefilled(window, 4)
    before = window.graph_captures()[0]
    planned = [RoundShape(1, 4, 16, 1), RoundShape(1, 2, 8, 1), RoundShape(3, 4, 16, 1),
               RoundShape(4, 4, 8, 1)]
    for shape in planned:
        window.forward_many([_round(shape, sequence) for sequence in range(shape.requests)])
    assert window.graph_captures()[0] == before  # every one of them replayed a warm graph
    assert window.forwards["eager"] == 0
    window.forward_many([_round(RoundShape(2, 4, 48, 1), sequence) for sequence in range(2)])
    assert window.graph_captures()[0] == before + 1  # a window of six blocks: outside the plan


def test_a_cpu_window_has_no_graphs_to_capture_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    window = WindowedLM(load_model(bundled_model_dir()).model, 128, max_batch=4)
    with caplog.at_level(logging.INFO, logger="lopa.execution"):
        assert warm_graphs(window, PARAMS, budget_tokens=None) == (0, 0.0)
    assert "no CUDA graphs on cpu: no graph buckets to capture before serving" in caplog.text
