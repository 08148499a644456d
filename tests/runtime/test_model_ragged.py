"""A ragged forward of several sequences gives each row the bits of its lone forward (CPU).

Three requests of different lengths, branch counts and attention modes run their rounds in one
`forward_many`; a twin model runs each alone. Logits and the K/V committed into every
sequence's cache must be bit-identical (lopa.model.invariant makes the linear products
batch-invariant; attention is per sequence, and within one per row).
"""

from __future__ import annotations

import pytest
import torch

from lopa.engine import bundled_model_dir
from lopa.model import DiffusionLM, WindowedLM
from lopa.model.invariant import tiled_linear
from lopa.model.loader import load_model
from lopa.model.protocol import WindowBatch
from lopa.params import AttentionMode

MAX_LENGTH = 64


@pytest.fixture(scope="module")
def model() -> DiffusionLM:
    # The bundled model's shapes: small enough to be quick, wide enough that a plain CPU GEMM's
    # blocking changes with the row count (the tiny test config's does not).
    return load_model(bundled_model_dir()).model


def _batch(
    seed: int,
    rows: int,
    width: int,
    start: int,
    n_stage: int,
    mode: AttentionMode,
    sequence: int,
    outputs: int,
) -> WindowBatch:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 90, (rows, width), generator=generator)
    lengths = [width - (row % 2) * min(4, width - max(1, n_stage)) for row in range(rows)]
    blocks = torch.tensor([[0] * min(width, 5) + [1] * max(0, width - 5)] * rows)
    wanted = [r * width + c for r in range(rows) for c in range(lengths[r])][:outputs]
    return WindowBatch(
        tokens, lengths, blocks, start, n_stage, mode, outputs=tuple(wanted), sequence=sequence
    )


def test_tiled_linear_is_row_invariant() -> None:
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 32, generator=generator), torch.randn(48, generator=generator)
    x = torch.randn(70, 32, generator=generator)
    with torch.no_grad():
        whole = tiled_linear(x, weight, bias)
        for offset, rows in [(0, 1), (3, 2), (5, 3), (17, 16), (20, 33), (69, 1)]:
            assert torch.equal(
                tiled_linear(x[offset : offset + rows].clone(), weight, bias), whole[offset : offset + rows]
            )
        assert torch.allclose(whole, torch.nn.functional.linear(x, weight, bias), atol=1e-5)


def test_ragged_forward_equals_each_sequence_alone(model: DiffusionLM) -> None:
    together = WindowedLM(model, MAX_LENGTH, max_batch=3)
    alone = WindowedLM(model, MAX_LENGTH, max_batch=3)
    modes = [AttentionMode.FULL, AttentionMode.BLOCK_CAUSAL, AttentionMode.FULL]
    starts = [0, 0, 0]
    for round_ in range(3):
        # Ragged: different rows (branch counts), widths and cache lengths per sequence. Alone, a
        # sequence's products have 1 to 3 rows at times (one token, one output): the row counts
        # where a plain CPU GEMM differs most from a batched one.
        batches = [
            _batch(
                100 * round_ + s,
                rows=(1, 4, 2)[s],
                width=(1, 13, 3)[s] + round_,
                start=starts[s],
                n_stage=(1, 3, 0)[s] if round_ == 0 else 1,
                mode=modes[s],
                sequence=s,
                outputs=(1, 40, 2)[s],
            )
            for s in range(3)
        ]
        if round_ == 2:
            batches = batches[::-1]  # the order inside a batch must not matter either
        got = together.forward_many(batches)
        for batch, logits in zip(batches, got, strict=True):
            expected = alone.forward(batch)
            assert torch.equal(logits, expected), f"round {round_}, sequence {batch.sequence}"
        for batch in batches:
            winner = batch.rows - 1
            together.commit(winner, batch.n_stage, batch.sequence)
            alone.commit(winner, batch.n_stage, batch.sequence)
            starts[batch.sequence] += batch.n_stage
    for sequence in range(3):
        n = together.cache_length(sequence)
        assert n == alone.cache_length(sequence) == starts[sequence] > 0
        assert torch.equal(together.caches[sequence].cache[:, :, :n], alone.caches[sequence].cache[:, :, :n])


def test_forward_many_refuses_a_sequence_twice_and_bad_sequences(model: DiffusionLM) -> None:
    window = WindowedLM(model, MAX_LENGTH, max_batch=2)
    batch = _batch(0, 1, 6, 0, 2, AttentionMode.FULL, 0, 3)
    with pytest.raises(ValueError, match="two batches for one sequence"):
        window.forward_many([batch, batch])
    with pytest.raises(ValueError, match=r"sequence 2 outside \[0, max_batch=2\)"):
        window.forward(_batch(0, 1, 6, 0, 2, AttentionMode.FULL, 2, 3))


@pytest.mark.parametrize("mode", list(AttentionMode))
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(model: DiffusionLM, mode: AttentionMode) -> None:
    """A candidate row gives the same logits alone, first or third among others, and padded to a
    wider row's width: so a request's rows split over 1, 2 or 3 workers, or cut by the branch
    budget, verify to the same bits (folded into one sequence they differed in the last bits)."""
    window = WindowedLM(model, MAX_LENGTH)
    window.reset(4)
    prompt = torch.randint(0, 90, (1, 12), generator=torch.Generator().manual_seed(3))
    blocks = torch.zeros(1, 12, dtype=torch.long)
    window.forward(WindowBatch(prompt, [12], blocks, 0, 12, mode))
    window.commit(0, 12)
    rows = torch.randint(0, 90, (4, 10), generator=torch.Generator().manual_seed(4))
    row_blocks = torch.tensor([[1] * 5 + [2] * 5] * 4)
    lengths = [10, 10, 7, 10]  # row 2 is shorter: padded beside the others

    def logits(order: list[int]) -> list[torch.Tensor]:
        width = max(lengths[r] for r in order)
        batch = WindowBatch(rows[order, :width], [lengths[r] for r in order], row_blocks[order, :width],
                            12, 0, mode)
        out = window.forward(batch)
        return [out[i, : lengths[r]] for i, r in enumerate(order)]

    alone = {r: logits([r])[0] for r in range(4)}
    for order in ([0, 1, 2, 3], [3, 2], [1, 0, 2], [2, 3, 0, 1]):
        for r, got in zip(order, logits(order), strict=True):
            assert torch.equal(got, alone[r]), f"row {r} in {order}"


@pytest.mark.parametrize("mode", list(AttentionMode))
def test_a_rows_bits_follow_from_the_row_alone(model: DiffusionLM, mode: AttentionMode, thread_count) -> None:
    """A row's logits and staged K/V are the same whatever its executor pads it to, whichever rows
    share its forward and on 1 or 2 threads: a worker holding some of a request's rows (padded to
    their own width, on its own thread count) verifies them as the local engine does. In
    block_causal mode every row, a cache-only one included, stages the very same K/V and last logit
    for the TO_CACHE head: each worker's own pre-write is the winner's (no broadcast). SDPA's CPU
    kernel gave a query other bits with its call's query and key counts and with the threads."""
    prompt = torch.randint(0, 90, (1, 12), generator=torch.Generator().manual_seed(3))
    rows = torch.randint(0, 90, (4, 21), generator=torch.Generator().manual_seed(4))
    rows[:, :5] = rows[0, :5]  # the TO_CACHE head, the same in every candidate
    row_blocks = torch.tensor([[1] * 5 + [2] * 8 + [3] * 8] * 4)
    lengths, n_stage = [5, 13, 21, 16], 5  # row 0: the TO_CACHE head only (a cache-only row)
    got: dict[int, list[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]]] = {r: [] for r in range(4)}
    for threads in (1, 2):
        thread_count(threads)
        for order in ([0], [1], [2], [3], [1, 2], [3, 1], [0, 1, 2, 3], [2, 0, 3]):
            window = WindowedLM(model, MAX_LENGTH)
            window.reset(4)
            window.forward(WindowBatch(prompt, [12], torch.zeros(1, 12, dtype=torch.long), 0, 12, mode))
            window.commit(0, 12)
            width = max(lengths[r] for r in order)
            batch = WindowBatch(rows[order, :width], [lengths[r] for r in order], row_blocks[order, :width],
                                12, n_stage, mode)
            out = window.forward(batch)
            layers = range(model.config.num_hidden_layers)
            for slot, r in enumerate(order):
                staged = [torch.cat(window.kv.staged(slot, layer)) for layer in layers]
                got[r].append((out[slot, : lengths[r]], out[slot, n_stage - 1], staged))
    for r, seen in got.items():
        for logits, _, staged in seen[1:]:
            assert torch.equal(logits, seen[0][0]), f"row {r}: logits"
            assert all(torch.equal(a, b) for a, b in zip(staged, seen[0][2], strict=True)), f"row {r}: K/V"
    if mode is AttentionMode.BLOCK_CAUSAL:
        head = [seen[0] for seen in got.values()]
        for _, last, staged in head[1:]:
            assert torch.equal(last, head[0][1])
            assert all(torch.equal(a, b) for a, b in zip(staged, head[0][2], strict=True))
