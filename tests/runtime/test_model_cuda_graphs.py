"""The pure parts of the CUDA graph path: shape buckets and the packed input layout (no GPU needed;
capture and replay run in tests/runtime/test_cuda.py on a GPU)."""

import pytest
import torch

from lopa.execution.protocol import WindowBatch
from lopa.model.cuda_graphs import (
    CACHE_STEP,
    MAX_BATCHED_WIDTH,
    MAX_TOKENS,
    MAX_WIDTH,
    WIDTH_STEP,
    Bucket,
    PackedInputs,
    bucket_for,
    padded_requests,
)
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


def test_a_round_of_several_requests_pads_to_one_bucket() -> None:
    # The largest request's rows, window and cache; the token limit counts every request.
    assert bucket_for(3, 20, 300, max_length=4096, requests=5) == Bucket(4, 32, 2 * CACHE_STEP, 5)
    assert bucket_for(4, 64, 0, max_length=4096, requests=MAX_TOKENS // 256) is not None
    assert bucket_for(4, 64, 0, max_length=4096, requests=MAX_TOKENS // 256 + 1) is None
    # A prompt-sized window beside other requests runs eagerly (its staging would grow every cache's).
    assert bucket_for(1, MAX_BATCHED_WIDTH + 1, 0, max_length=4096, requests=2) is None
    assert bucket_for(1, MAX_BATCHED_WIDTH + 1, 0, max_length=4096) is not None


def test_packed_layout_of_several_requests() -> None:
    bucket = Bucket(2, 16, 256, requests=3)
    layout = PackedInputs(bucket)
    tokens, rows = 3 * 2 * 16, 3 * 2
    assert bucket.tokens == tokens and bucket.request_tokens == 32
    assert (layout.lengths.start, layout.lengths.stop) == (2 * tokens, 2 * tokens + rows)
    assert layout.outputs == layout.scalars + 3 * 3  # start, cache length, block_causal per request
    assert layout.size - layout.outputs == tokens + rows


@pytest.mark.parametrize(
    ("requests", "limit", "padded"),
    [(1, 16, 1), (2, 16, 2), (3, 16, 3), (4, 16, 4), (5, 16, 6), (7, 16, 8), (9, 16, 12), (13, 16, 16),
     (17, 64, 24), (25, 64, 32), (9, 10, 10), (9, 9, 9), (5, 4, 5)],
)
def test_request_counts_pad_to_a_third_at_most(requests: int, limit: int, padded: int) -> None:
    # 1, 2, 3, 4, 6, 8, 12, 16, 24, 32...: never past the caches there are, never below the round.
    assert padded_requests(requests, limit) == padded


@pytest.mark.parametrize("widths", [(5, 5, 5), (5, 9, 3), (7,)])
def test_a_round_is_written_into_its_bucket_request_by_request(widths: tuple[int, ...]) -> None:
    # Each request's rows in its own block of the bucket, padding rows of one token, its scalars,
    # and its output indices re-based from its [rows, width] layout onto the bucket's.
    bucket = Bucket(4, 16, 256, requests=4)  # one request more than the round: padding
    layout = PackedInputs(bucket)
    batches = []
    for i, width in enumerate(widths):
        rows = 1 + i % 3
        tokens = torch.arange(rows * width).view(rows, width) + 100 * (i + 1)
        outputs = tuple(range(0, rows * width, 2)) if i != 1 else ()  # one request needs no logit
        mode = AttentionMode.BLOCK_CAUSAL if i % 2 else AttentionMode.FULL
        batches.append(WindowBatch(tokens, [width - r for r in range(rows)], tokens % 3, 10 * i, 1, mode,
                                   outputs=outputs))
    host = torch.zeros(layout.size, dtype=torch.long)
    counts = layout.write(host, batches, [7 * (i + 1) for i in range(len(widths))])
    assert counts == [len(b.outputs) for b in batches]
    tokens = host[layout.tokens].view(4, 4, 16)
    block_ids = host[layout.block_ids].view(4, 4, 16)
    lengths = host[layout.lengths].view(4, 4)
    scalars = host[layout.scalars : layout.outputs].view(4, 3)
    indices = host[layout.outputs : layout.outputs + sum(counts)].tolist()
    expected = []
    for i, batch in enumerate(batches):
        assert torch.equal(tokens[i, : batch.rows, : batch.width], batch.tokens)
        assert torch.equal(block_ids[i, : batch.rows, : batch.width], batch.block_ids)
        assert lengths[i].tolist() == batch.lengths + [1] * (4 - batch.rows)
        assert scalars[i].tolist() == [10 * i, 7 * (i + 1), i % 2]
        mine = [i * bucket.request_tokens + o // batch.width * 16 + o % batch.width for o in batch.outputs]
        if mine:
            assert torch.equal(tokens.reshape(-1)[mine], batch.tokens.reshape(-1)[::2])  # the same tokens
        expected += mine
    assert indices == expected
    assert lengths[len(widths):].eq(1).all() and scalars[len(widths):].eq(0).all()  # padding requests


def test_a_request_s_lengths_must_match_its_rows() -> None:
    layout = PackedInputs(Bucket(4, 16, 256, requests=2))
    tokens = torch.zeros(2, 5, dtype=torch.long)
    batch = WindowBatch(tokens, [5, 4, 3], tokens, 0, 1, AttentionMode.FULL, outputs=(0,))
    with pytest.raises(ValueError, match="3 lengths for 2 rows"):
        layout.write(torch.zeros(layout.size, dtype=torch.long), [batch], [0])
