"""Row-exact attention for CPU: a row's bits follow from that row alone.

SDPA's CPU kernel gives a query other bits with the number of queries and (masked) keys of its call
and with the thread count, so one request's rows split over several workers (each padding its rows
to its own width, with its own threads) decoded otherwise than on one. Here each row attends
unpadded through two bmm products per KV head, [M, D] x [D, keys] and [M, keys] x [keys, D], whose
shapes follow from the row alone: M stacks the KV head's `repeat` query heads over the row's span of
queries, rounded up to a multiple of ROWS_GRANULE; keys are the cache then the row's window, rounded
up to a multiple of KEY_GRANULE. Rows of one length share the calls. bmm gives an item the same
bits whatever the batch and threads for these shapes (on the machine we measured, a product of
5-11 rows alone on 2 threads did not, hence the granule); test_exact_attention checks it for
single products, test_model_ragged's test_a_rows_bits_follow_from_the_row_alone end to end.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lopa.model.protocol import WindowBatch
from lopa.params import AttentionMode

ROWS_GRANULE = 16  # a product's query rows (heads x queries) are a multiple of this
KEY_GRANULE = 8  # and its keys (kept from the tile version, where a 1-key product changed with the batch)


@dataclass(frozen=True)
class RowSpan:
    """Queries [lo, hi) of the rows `index`, rows of one length, each attending to the first
    `key_count` keys of its row; every key the mask hides there (tokens after a closed head, the
    row's padding, the zero tail) gets probability 0. The queries are padded to `query_count`
    (repeat * query_count a multiple of ROWS_GRANULE). `mask` is additive, [rows, query_count,
    key_count] (0 at padded queries), built once per forward for every layer. A `shared` span (the
    block_causal TO_CACHE head, the same tokens in every row) is computed on the first row and
    written to every row."""

    index: slice | torch.Tensor
    lo: int
    hi: int
    query_count: int
    key_count: int
    mask: torch.Tensor
    shared: bool = False


def row_spans(
    mask: torch.Tensor,
    lengths: Sequence[int],
    head: int,
    cached: int,
    repeat: int,
    shared_head: bool = False,
) -> tuple[RowSpan, ...]:
    """A segment's spans, from its additive mask [R, 1, W, cached + W]: rows grouped by length. In
    block_causal mode with a closed TO_CACHE `head` (> 0; decided for the whole segment, see
    lopa.model.window._closed_head), each group's head apart (it sees the cache and itself only),
    then its tokens after it, which see the cache and their whole row; with `shared_head` (the
    head's tokens and blocks are the same in every row, as in a decoder's candidates) the head once
    for all rows. `repeat`: query heads per KV head."""
    spans = []
    if head and shared_head:
        spans.append(_span(mask, slice(0, 1), 0, head, cached + head, repeat, shared=True))
    for n in sorted(set(lengths)):
        members = [r for r, length in enumerate(lengths) if length == n]
        index = slice(None) if len(members) == len(lengths) else torch.tensor(members, device=mask.device)
        if head and not shared_head:
            spans.append(_span(mask, index, 0, head, cached + head, repeat))
        if n > head:  # else a cache-only row: its head is all it has
            spans.append(_span(mask, index, head, n, cached + n, repeat))
    return tuple(spans)


def _span(
    mask: torch.Tensor, index: slice | torch.Tensor, lo: int, hi: int, seen: int, repeat: int,
    shared: bool = False,
) -> RowSpan:
    query_count = _round_up(hi - lo, ROWS_GRANULE // math.gcd(ROWS_GRANULE, repeat))
    key_count = _round_up(seen, KEY_GRANULE)
    own = mask[index, 0, lo:hi, :seen]
    if key_count > seen:
        own = F.pad(own, (0, key_count - seen), value=float("-inf"))
    if query_count > hi - lo:
        own = F.pad(own, (0, 0, 0, query_count - (hi - lo)))  # padded queries see every key: no NaN
    return RowSpan(index, lo, hi, query_count, key_count, own.contiguous(), shared)


def _round_up(n: int, granule: int) -> int:
    return -(-n // granule) * granule


def attend_rows_exact(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spans: Sequence[RowSpan],
    past: tuple[torch.Tensor, torch.Tensor] | None,
    on_kv: Callable[[torch.Tensor, torch.Tensor], None] | None,
    out: torch.Tensor,
) -> None:
    """Attention of rows [R, W, heads | kv_heads, D] over the cached prefix [C, kv_heads, D] and
    their own window keys/values (staged first through on_kv), span by span, into `out`
    [R, W, heads, D] (padded queries are left as they are)."""
    if on_kv is not None:
        on_kv(k, v)
    width, heads, dim = q.shape[1:]
    past_k, past_v = past if past is not None else (k[0, :0], v[0, :0])
    tail = max(0, max(span.key_count for span in spans) - past_k.shape[0] - width)
    keys, values = _keys_by_row(past_k, k, tail), _keys_by_row(past_v, v, tail)  # [R, kv_heads, N, D]
    for span in spans:
        index, count, queries, n = span.index, span.hi - span.lo, span.query_count, span.key_count
        group = span.mask.shape[0]
        span_q = q[index, span.lo : span.hi].transpose(1, 2)  # [G, heads, count, D]
        span_k, span_v = (t[index, :, :n] for t in (keys, values))
        part = _span_products(span_q, span_k, span_v, span).view(group, heads, queries, dim)
        out[slice(None) if span.shared else index, span.lo : span.hi] = part[:, :, :count].transpose(1, 2)


def attend_row_alone(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spans: Sequence[RowSpan],
    past: tuple[torch.Tensor, torch.Tensor] | None,
    on_kv: Callable[[torch.Tensor, torch.Tensor], None] | None,
) -> torch.Tensor:
    """attend_rows_exact of one row [1, W, heads | kv_heads, D] whose spans cover its W queries in
    order (a lone request's round at k = 0): every product on the operands attend_rows_exact gives
    it, so the same bits, with fewer small ops around them (no output buffer to zero and fill, no
    per-row indexing): a small model's lone round spends more on such ops than on its products.
    Returns [1, heads, W, D]."""
    if on_kv is not None:
        on_kv(k, v)
    width, dim = q.shape[1], q.shape[3]
    past_k, past_v = past if past is not None else (k[0, :0], v[0, :0])
    keys_count = spans[0].key_count if len(spans) == 1 else max(span.key_count for span in spans)
    tail = max(0, keys_count - past_k.shape[0] - width)
    keys, values = _keys_alone(past_k, k, tail), _keys_alone(past_v, v, tail)  # [1, kv_heads, N, D]
    parts = []
    for span in spans:
        n, count = span.key_count, span.hi - span.lo
        span_q = q if count == width else q[:, span.lo : span.hi]
        span_k, span_v = (keys, values) if n == keys.shape[2] else (keys[:, :, :n], values[:, :, :n])
        part = _span_products(span_q.transpose(1, 2), span_k, span_v, span).view(1, -1, span.query_count, dim)
        parts.append(part if span.query_count == count else part[:, :, :count])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def _keys_alone(past: torch.Tensor, window: torch.Tensor, tail: int) -> torch.Tensor:
    """_keys_by_row of one row: the same tensor, from fewer ops."""
    parts = [past.transpose(0, 1)[None], window.transpose(1, 2)]
    if tail:
        parts.append(window.new_zeros(1, window.shape[2], tail, window.shape[3]))
    return torch.cat(parts, dim=2)


def _span_products(
    span_q: torch.Tensor, span_k: torch.Tensor, span_v: torch.Tensor, span: RowSpan
) -> torch.Tensor:
    """The span's scores, softmax and weighted values for its G rows: span_q [G, heads, count, D],
    span_k / span_v [G, kv_heads, key_count, D]; returns [G * kv_heads, repeat * query_count, D]."""
    group, heads, count, dim = span_q.shape
    kv_heads, n, queries = span_k.shape[1], span.key_count, span.query_count
    if queries > count:
        span_q = F.pad(span_q, (0, 0, 0, queries - count))
    span_k, span_v = span_k.reshape(group * kv_heads, n, dim), span_v.reshape(group * kv_heads, n, dim)
    # The mask broadcast over the query heads into the scores, then the product added in place
    # (what baddbmm would do with a per-head copy of the mask, without keeping that copy).
    scores = span_q.new_empty(group * kv_heads, heads // kv_heads * queries, n)
    scores.view(group, kv_heads, heads // kv_heads, queries, n).copy_(span.mask[:, None, None])
    scores.baddbmm_(span_q.reshape(group * kv_heads, -1, dim), span_k.transpose(1, 2), alpha=dim**-0.5)
    return torch.bmm(torch.softmax(scores, dim=-1), span_v)


def _keys_by_row(past: torch.Tensor, window: torch.Tensor, tail: int) -> torch.Tensor:
    """[R, kv_heads, C + W + tail, D]: the cached keys (or values) [C, kv_heads, D], then each row's
    window [R, W, kv_heads, D], then `tail` zeros."""
    rows, _, kv_heads, dim = window.shape
    parts = [past.transpose(0, 1).unsqueeze(0).expand(rows, -1, -1, -1), window.transpose(1, 2)]
    if tail:
        parts.append(window.new_zeros(1, 1, 1, 1).expand(rows, kv_heads, tail, dim))
    return torch.cat(parts, dim=2)


def closed_head(batch: WindowBatch) -> int:
    """The TO_CACHE tokens that attend apart (lopa.model.exact_attention.row_spans): in
    block_causal mode, when they end at a block boundary in every row, they see only the cache and
    themselves, so computing them alone gives every row the same bits. Otherwise (full attention; a
    head cutting a block, which a decoder never stages) 0: they attend with their row under its
    mask. Decided for the whole batch, so a row's split would follow its neighbours only in that
    never-staged case."""
    n = batch.n_stage
    if batch.mode is not AttentionMode.BLOCK_CAUSAL or n == 0:
        return 0
    for row, length in enumerate(batch.lengths):
        if length > n and int(batch.block_ids[row, n]) == int(batch.block_ids[row, n - 1]):
            return 0
    return n


def same_head(batch: WindowBatch, head: int) -> bool:
    """Whether every row begins with the same `head` tokens in the same blocks (a decoder's
    candidates share their TO_CACHE tokens): the head's attention is then computed once."""
    tokens, blocks = batch.tokens[:, :head], batch.block_ids[:, :head]
    return bool((tokens == tokens[:1]).all() and (blocks == blocks[:1]).all())
