"""The pure parts of the CUDA graph path: shape buckets and the packed input layout (no GPU needed;
capture and replay run in tests/runtime/test_cuda.py on a GPU)."""

import pytest
import torch

from lopa.model.graph_layout import (
    CACHE_STEP,
    MAX_BATCHED_WIDTH,
    MAX_LAYOUT_TOKENS,
    MAX_TOKENS,
    MAX_WIDTH,
    WIDTH_STEP,
    Bucket,
    PackedInputs,
    bucket_for,
    compact_tokens,
    padded_requests,
)
from lopa.model.protocol import WindowBatch
from lopa.params import AttentionMode


@pytest.mark.parametrize(
    ("rows", "width", "cache", "expected"),
    [
        (1, 1, 0, Bucket(1, WIDTH_STEP, 0)),
        (3, 17, 1, Bucket(4, 2 * WIDTH_STEP, CACHE_STEP)),
        (4, 64, CACHE_STEP, Bucket(4, 64, CACHE_STEP)),
        (5, 64, CACHE_STEP + 1, Bucket(8, 64, 2 * CACHE_STEP)),
        # The cache read grows by powers of two: fewer buckets as caches grow, each captured once.
        (1, 32, 3 * CACHE_STEP - 1, Bucket(1, 32, 4 * CACHE_STEP)),
        (1, 32, 4 * CACHE_STEP + 1, Bucket(1, 32, 8 * CACHE_STEP)),
    ],
)
def test_forwards_pad_up_to_their_bucket(rows: int, width: int, cache: int, expected: Bucket) -> None:
    assert bucket_for(rows, width, cache, max_length=4096) == expected


def test_the_cache_read_never_exceeds_the_cache() -> None:
    assert bucket_for(1, 16, 300, max_length=320).cache_width == 320


def test_large_forwards_run_eagerly() -> None:
    assert bucket_for(1, MAX_WIDTH + 1, 0, max_length=4096) is None  # a prefill
    assert bucket_for(MAX_TOKENS // 64 + 1, 64, 0, max_length=4096) is None
    assert bucket_for(1, 24, 0, max_length=20) is None  # padding past the model's length


def test_packed_layout_is_contiguous_and_sized_for_every_output() -> None:
    layout = PackedInputs(Bucket(4, 32, 256))
    tokens = 4 * 32
    assert (layout.tokens.start, layout.tokens.stop) == (0, tokens)
    assert (layout.block_ids.start, layout.block_ids.stop) == (tokens, 2 * tokens)
    assert (layout.lengths.start, layout.lengths.stop) == (2 * tokens, 2 * tokens + 4)
    assert layout.scalars == 2 * tokens + 4 and layout.outputs == layout.scalars + 3
    assert layout.size - layout.outputs == tokens + 4  # every masked position plus one last logit per row


def test_a_round_of_several_requests_is_compact() -> None:
    # Attention's layout: the largest request's rows and window (powers of two) and cache; the
    # linear products: the real tokens, rounded up.
    assert bucket_for(3, 20, 300, max_length=4096, requests=5, tokens=150) == Bucket(
        4, 32, 2 * CACHE_STEP, 5, compact=192
    )
    assert bucket_for(1, 16, 0, max_length=4096, requests=2, tokens=20).compact == 32  # never past the layout
    assert bucket_for(4, 64, 0, max_length=4096, requests=MAX_LAYOUT_TOKENS // 256, tokens=512) is not None
    assert bucket_for(4, 64, 0, max_length=4096, requests=MAX_LAYOUT_TOKENS // 256 + 1, tokens=512) is None
    assert bucket_for(4, 128, 0, max_length=4096, requests=8, tokens=MAX_TOKENS + 1) is None
    # A prompt-sized window beside other requests runs eagerly (its staging would grow every cache's).
    assert bucket_for(1, MAX_BATCHED_WIDTH + 1, 0, max_length=4096, requests=2, tokens=200) is None
    assert bucket_for(1, MAX_BATCHED_WIDTH + 1, 0, max_length=4096) is not None


@pytest.mark.parametrize(
    ("tokens", "compact"), [(1, 64), (64, 64), (65, 128), (256, 256), (257, 384), (500, 512)]
)
def test_compact_rounds_round_their_tokens_to_few_sizes(tokens: int, compact: int) -> None:
    assert compact_tokens(tokens) == compact


def test_packed_layout_of_a_compact_round() -> None:
    bucket = Bucket(2, 16, 256, requests=3, compact=64)
    layout = PackedInputs(bucket)
    slots, rows = 3 * 2 * 16, 3 * 2
    assert bucket.tokens == slots and bucket.linear_tokens == 64 and bucket.request_tokens == 32
    assert (layout.tokens.start, layout.tokens.stop) == (0, 64)
    assert (layout.slots.start, layout.slots.stop) == (64, 128)
    assert (layout.block_ids.start, layout.block_ids.stop) == (128, 128 + slots)
    assert (layout.lengths.start, layout.lengths.stop) == (128 + slots, 128 + slots + rows)
    assert layout.outputs == layout.scalars + 3 * 3  # start, cache length, block_causal per request
    assert layout.size - layout.outputs == 64 + rows


@pytest.mark.parametrize(
    ("requests", "limit", "padded"),
    [(1, 16, 1), (2, 16, 2), (3, 16, 3), (4, 16, 4), (5, 16, 6), (7, 16, 8), (9, 16, 12), (13, 16, 16),
     (17, 64, 24), (25, 64, 32), (9, 10, 10), (9, 9, 9), (5, 4, 5)],
)
def test_request_counts_pad_to_a_third_at_most(requests: int, limit: int, padded: int) -> None:
    # 1, 2, 3, 4, 6, 8, 12, 16, 24, 32...: never past the caches there are, never below the round.
    assert padded_requests(requests, limit) == padded


def _round(widths: tuple[int, ...]) -> list[WindowBatch]:
    """Requests of 1, 2, 3, 1... rows of these widths, alternating modes, one needing no logit."""
    batches = []
    for i, width in enumerate(widths):
        rows = 1 + i % 3
        tokens = torch.arange(rows * width).view(rows, width) + 100 * (i + 1)
        outputs = tuple(range(0, rows * width, 2)) if i != 1 else ()
        mode = AttentionMode.BLOCK_CAUSAL if i % 2 else AttentionMode.FULL
        batches.append(WindowBatch(tokens, [width - r for r in range(rows)], tokens % 3, 10 * i, 1, mode,
                                   outputs=outputs))
    return batches


@pytest.mark.parametrize("widths", [(5, 5, 5), (5, 9, 3), (16, 16, 16), (16, 16)])
def test_a_compact_round_packs_its_tokens_and_places_each_in_its_block(widths: tuple[int, ...]) -> None:
    # The linear products see the real tokens packed request after request; each token's slot is
    # its place in its request's block of the padded layout, where attention runs: padding rows of
    # one token, the request's scalars; output indices point at the packed tokens.
    batches = _round(widths)
    real = sum(b.rows * b.width for b in batches)
    bucket = Bucket(4, 16, 256, requests=4, compact=compact_tokens(real))  # one padding request
    layout = PackedInputs(bucket)
    host = torch.zeros(layout.size, dtype=torch.long)
    counts = layout.write(host, batches, [7 * (i + 1) for i in range(len(widths))])
    assert counts == [len(b.outputs) for b in batches]
    packed, slots = host[layout.tokens], host[layout.slots]
    padded = torch.zeros(bucket.tokens, dtype=torch.long).index_copy_(0, slots[:real], packed[:real])
    padded = padded.view(4, 4, 16)
    block_ids = host[layout.block_ids].view(4, 4, 16)
    lengths = host[layout.lengths].view(4, 4)
    scalars = host[layout.scalars : layout.outputs].view(4, 3)
    indices = host[layout.outputs : layout.outputs + sum(counts)]
    assert torch.equal(packed[:real], torch.cat([b.tokens.reshape(-1) for b in batches]))
    assert len(set(slots[:real].tolist())) == real  # one slot per real token
    for i, batch in enumerate(batches):
        assert torch.equal(padded[i, : batch.rows, : batch.width], batch.tokens)
        assert torch.equal(block_ids[i, : batch.rows, : batch.width], batch.block_ids)
        assert lengths[i].tolist() == batch.lengths + [1] * (4 - batch.rows)
        assert scalars[i].tolist() == [10 * i, 7 * (i + 1), i % 2]
    expected = torch.cat([b.tokens.reshape(-1)[list(b.outputs)] for b in batches])
    assert torch.equal(packed[indices], expected)  # the same tokens
    assert lengths[len(widths):].eq(1).all() and scalars[len(widths):].eq(0).all()  # padding request
    # Padding tokens share a slot no real token has, whose key every real query has masked.
    spare = set(slots[real:].tolist())
    assert len(spare) == 1 and not spare & set(slots[:real].tolist())
    request, row, column = _place(slots[-1])
    assert request >= len(batches) or row >= batches[request].rows or column >= batches[request].lengths[row]


def _place(slot: torch.Tensor) -> tuple[int, int, int]:
    """(request, row, column) of a slot of the 4 x 4 x 16 layout above."""
    request, rest = divmod(int(slot), 4 * 16)
    return (request, *divmod(rest, 16))


def test_a_lone_request_pads_its_rows_and_window() -> None:
    bucket = Bucket(4, 16, 256)
    layout = PackedInputs(bucket)
    (batch,) = _round((5,))
    host = torch.zeros(layout.size, dtype=torch.long)
    assert layout.write(host, [batch], [3]) == [len(batch.outputs)]
    tokens = host[layout.tokens].view(4, 16)
    assert torch.equal(tokens[:1, :5], batch.tokens) and layout.slots.start == layout.slots.stop
    indices = host[layout.outputs : layout.outputs + len(batch.outputs)]
    assert torch.equal(tokens.reshape(-1)[indices], batch.tokens.reshape(-1)[::2])


def test_a_compact_bucket_refuses_more_tokens_than_it_holds() -> None:
    layout = PackedInputs(Bucket(4, 16, 256, requests=3, compact=64))
    with pytest.raises(ValueError, match="96 tokens for a bucket of 64"):
        layout.write(torch.zeros(layout.size, dtype=torch.long), _round((16, 16, 16)), [0, 0, 0])


def test_a_request_s_lengths_must_match_its_rows() -> None:
    layout = PackedInputs(Bucket(4, 16, 256, requests=2))
    tokens = torch.zeros(2, 5, dtype=torch.long)
    batch = WindowBatch(tokens, [5, 4, 3], tokens, 0, 1, AttentionMode.FULL, outputs=(0,))
    with pytest.raises(ValueError, match="3 lengths for 2 rows"):
        layout.write(torch.zeros(layout.size, dtype=torch.long), [batch], [0])
