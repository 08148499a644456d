"""Row-exact CPU attention (lopa.model.exact_attention): the same values as SDPA, and a row's bits
its own whatever shares its call, whatever its executor pads it to and on 1 or 2 threads, for
grouped-query shapes from multi-query (one KV head) to Dream-7B's 7 query heads per KV head."""

from __future__ import annotations

import pytest
import torch

from lopa.model.attention import attend_with_past
from lopa.model.exact_attention import attend_row_alone, attend_rows_exact, row_spans
from lopa.model.mask import additive, row_masks

DIM = 16
CACHED = 11


def _inputs(seed: int, rows: int, width: int, heads: int, kv_heads: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, width, heads, DIM, generator=generator)
    k, v = (torch.randn(rows, width, kv_heads, DIM, generator=generator) for _ in range(2))
    past = tuple(torch.randn(CACHED, kv_heads, DIM, generator=generator) for _ in range(2))
    return q, k, v, *past


def _attend(q, k, v, past_k, past_v, lengths, head: int, causal: bool, shared: bool = False):
    """attend_rows_exact on rows [R, W, ...] -> ([R, W, heads, D], the additive mask)."""
    rows, width, heads, _ = q.shape
    blocks = torch.tensor([[0] * head + [1 + (c - head) // 4 for c in range(head, width)]] * rows)
    mask = additive(row_masks(torch.tensor(lengths), blocks, CACHED, causal), q.dtype)
    spans = row_spans(mask, lengths, head, CACHED, heads // k.shape[2], shared_head=shared)
    out = q.new_zeros(q.shape)
    attend_rows_exact(q, k, v, spans, (past_k, past_v), None, out)
    return out, mask


@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 1), (4, 2), (7, 1), (14, 2)])
@pytest.mark.parametrize(("causal", "shared"), [(False, False), (True, False), (True, True)])
def test_it_matches_sdpa(heads: int, kv_heads: int, causal: bool, shared: bool) -> None:
    """In block_causal mode a TO_CACHE head attends apart: per row, or once for all rows when they
    share it (a decoder's candidates)."""
    q, k, v, past_k, past_v = _inputs(0, 3, 19, heads, kv_heads)
    lengths, head = [19, 12, 4], (4 if causal else 0)
    if shared:
        for t in (q, k, v):
            t[:, :head] = t[0, :head]
    got, mask = _attend(q, k, v, past_k, past_v, lengths, head, causal, shared)
    want = attend_with_past(q, k, v, mask, (past_k, past_v), None).transpose(1, 2)  # SDPA
    for row, n in enumerate(lengths):
        torch.testing.assert_close(got[row, :n], want[row, :n], atol=1e-5, rtol=1e-5)
        assert not got[row, n:].any(), "padded queries are left untouched"


@pytest.mark.parametrize(("heads", "kv_heads"), [(1, 1), (2, 1), (4, 2), (7, 1)])
@pytest.mark.parametrize(("head", "shared"), [(0, False), (3, False), (3, True)])
def test_a_rows_bits_are_its_own(heads: int, kv_heads: int, head: int, shared: bool, thread_count) -> None:
    """Every span length 1-12 (product rows from 1 upward: a lone product of 5-11 rows on 2 threads
    got other bits than in a batch on one of our machines), alone, beside other rows and padded
    wider, on 1 and 2 threads; with a block_causal TO_CACHE head attending apart, per row or shared
    (the same bits either way)."""
    causal = head > 0
    for n in range(max(1, head), 13):
        q, k, v, past_k, past_v = _inputs(n, 3, 16, heads, kv_heads)
        for t in (q, k, v):  # the head: the same tokens in every row
            t[:, :head] = t[0, :head]
        reference = None
        for threads in (1, 2):
            thread_count(threads)
            for rows, width, lengths in ((1, n, [n]), (1, 16, [n]), (3, 16, [n, 16, 9]), (2, 14, [n, n])):
                for share in {shared, False}:
                    got, _ = _attend(q[:rows, :width], k[:rows, :width], v[:rows, :width], past_k, past_v,
                                     lengths, head, causal, share)
                    if reference is None:
                        reference = got[0, :n].clone()
                    assert torch.equal(got[0, :n], reference), (n, threads, rows, width, share)


@pytest.mark.parametrize(("heads", "kv_heads"), [(1, 1), (4, 2), (7, 1)])
@pytest.mark.parametrize(("head", "causal"), [(0, False), (0, True), (4, True)])
def test_a_lone_row_gets_the_bits_of_the_rows_path(heads: int, kv_heads: int, head: int, causal: bool,
                                                    thread_count) -> None:
    """attend_row_alone (a request's round at k = 0) against attend_rows_exact on the same row, bit
    for bit: widths whose queries or keys the products pad (1-13, 16, 21), with a TO_CACHE head
    attending apart (per row or shared), on 1 and 2 threads."""
    for threads in (1, 2):
        thread_count(threads)
        for width in [*range(max(1, head), 14), 16, 21]:
            q, k, v, past_k, past_v = _inputs(width, 1, width, heads, kv_heads)
            blocks = torch.tensor([[0] * head + [1 + (c - head) // 4 for c in range(head, width)]])
            mask = additive(row_masks(torch.tensor([width]), blocks, CACHED, causal), q.dtype)
            for shared in {False, head > 0}:
                spans = row_spans(mask, [width], head, CACHED, heads // kv_heads, shared_head=shared)
                want = q.new_zeros(q.shape)
                attend_rows_exact(q, k, v, spans, (past_k, past_v), None, want)
                got = attend_row_alone(q, k, v, spans, (past_k, past_v), None)
                assert torch.equal(got.transpose(1, 2), want), (threads, width, shared)
