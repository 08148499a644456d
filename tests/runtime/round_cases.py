"""Rounds of ragged requests joining and leaving, shared by the CPU check of the CUDA graph path
(test_model_round_graphs.py) and its GPU run (test_cuda.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from lopa.model.protocol import WindowBatch, WindowModel
from lopa.params import AttentionMode

MAX_LENGTH = 96
# Each round: the sequences that share it (in the caller's order), so requests join, leave and
# come back in other physical places.
ROUNDS = [[0, 1, 2], [2, 3], [3], [1, 3, 0], [0, 1, 2, 3], [2], [3, 1]]


def round_batch(seed: int, sequence: int, start: int) -> WindowBatch:
    generator = torch.Generator().manual_seed(seed)
    rows = 1 + seed % 3
    width = 5 + seed % 11
    n_stage = min(width, 1 + seed % 3)
    tokens = torch.randint(0, 90, (rows, width), generator=generator)
    lengths = [width - (row % 2) * min(3, width - n_stage) for row in range(rows)]
    blocks = torch.tensor([[0] * min(width, 4) + [1] * max(0, width - 4)] * rows)
    mode = (AttentionMode.FULL, AttentionMode.BLOCK_CAUSAL)[seed % 2]
    outputs = tuple(r * width + c for r in range(rows) for c in range(lengths[r]) if c % 2 == 0)
    return WindowBatch(tokens, lengths, blocks, start, n_stage, mode, outputs=outputs, sequence=sequence)


def play_rounds(
    eager: WindowModel,
    graphed: WindowModel,
    rounds: Sequence[Sequence[int]] = ROUNDS,
    after_forward: Callable[[Sequence[int]], None] = lambda sequences: None,
) -> None:
    """Each round through both window models, its logits compared (the graph body folds rows as an
    accelerator does, the CPU's eager path attends row by row: equal to rounding), then every
    request commits its last row's TO_CACHE tokens in both."""
    for number, sequences in enumerate(rounds):
        batches = [round_batch(10 * number + s, s, eager.cache_length(s)) for s in sequences]
        for want, got in zip(eager.forward_many(batches), graphed.forward_many(batches), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        after_forward(sequences)
        for batch in batches:
            for window in (eager, graphed):
                window.commit(batch.rows - 1, batch.n_stage, batch.sequence)
