"""Attention over a KV cache, the model's side of it: what a layer reads (the cached keys and values
through `KVSource`), how it hands its new keys/values to the cache (a `KVCallback`), and the
layouts of a ragged forward of several requests folded into one sequence: `Segment`s, one per
request, or `UniformSegments` when the requests are of equal size and their caches share one tensor
(a CUDA-graph round: one attention call per layer for all of them)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

RowGroup = tuple[int, slice | torch.Tensor]  # (a length, the rows of that length as an index)

# Called once per layer with that layer's window keys/values [R, L, kv_heads, head_dim] (after RoPE).
KVCallback = Callable[[int, torch.Tensor, torch.Tensor], None]


class KVSource(Protocol):
    def cached(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached keys and values of `layer`, each [C, kv_heads, head_dim], shared by every row."""


@dataclass(frozen=True)
class Segment:
    """One request's tokens [begin, end) of a ragged forward (several requests folded into one
    sequence): they attend only to their own cache and to each other, under their own mask.

    With rows > 1 the tokens are `rows` rows of equal width that attend row by row, each to the
    cache and to itself only, under masks [rows, 1, width, C + width] (lopa.model.mask.row_masks);
    with rows == 1, as one sequence under a mask [1, 1, T, C + T].

    With `row_groups` (CPU), each row attends unpadded through fixed-shape products (attend_rows_exact):
    its bits then depend on that row alone, not on the width its executor padded it to, the rows
    beside it or the thread count; in block_causal mode its first `head` (TO_CACHE) tokens attend
    apart, to the cache and the head only, so every row stages the very same K/V for them."""

    begin: int
    end: int
    mask: torch.Tensor | None
    past: KVSource | None
    on_kv: KVCallback | None
    rows: int = 1
    row_groups: tuple[RowGroup, ...] | None = None
    head: int = 0


@dataclass(frozen=True)
class UniformSegments:
    """`requests` requests of equal token count folded into one batch-1 sequence (a CUDA-graph
    bucket pads them so), each attending to its own cache and tokens under its own mask; their
    caches are slices of one tensor, so each layer attends once with batch = request. Per request
    and layer that saves a K and a V concatenation and an attention call: measured on an H100 with a
    7B model, such small kernels were ~9 ms of a 31 ms round of 16 requests."""

    requests: int
    mask: torch.Tensor  # additive [requests, 1, T / requests, C + T / requests]
    past: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # layer -> K, V [requests, C, kv_heads, D]
    on_kv: KVCallback  # layer, K, V [requests, T / requests, kv_heads, D]: each request's to its cache


@dataclass(frozen=True)
class LayerUniform:
    """UniformSegments bound to one layer."""

    requests: int
    mask: torch.Tensor
    past: tuple[torch.Tensor, torch.Tensor]
    on_kv: Callable[[torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class LayerSegment:
    """A Segment bound to one layer: its cached K/V and its staging callback."""

    begin: int
    end: int
    mask: torch.Tensor | None
    past: tuple[torch.Tensor, torch.Tensor] | None
    on_kv: Callable[[torch.Tensor, torch.Tensor], None] | None
    rows: int = 1
    row_groups: tuple[RowGroup, ...] | None = None
    head: int = 0


def attend_segments(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Sequence[LayerSegment]
) -> torch.Tensor:
    """Attention of a folded batch-1 forward, segment by segment (see Segment); [1, heads, T, D]."""
    parts = []
    for s in segments:
        tokens = slice(s.begin, s.end)
        qs, ks, vs = q[:, tokens], k[:, tokens], v[:, tokens]
        if s.rows > 1:  # [1, R * W, h, D] -> [R, W, h, D]: one batch element per row
            qs, ks, vs = (t.reshape(s.rows, -1, *t.shape[2:]) for t in (qs, ks, vs))
        if s.row_groups is not None:
            out = attend_rows_exact(qs, ks, vs, s)  # [R, heads, W, D]
        else:
            out = attend_with_past(qs, ks, vs, s.mask, s.past, s.on_kv)  # [R, heads, W, D]
        if s.rows > 1:
            out = out.transpose(0, 1).reshape(1, out.shape[1], -1, out.shape[3])
        parts.append(out)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def attend_uniform(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: LayerUniform) -> torch.Tensor:
    """Attention of a folded batch-1 forward of equal-sized requests (see UniformSegments), one
    batch element per request; [1, heads, T, D]."""
    q, k, v = (t.reshape(s.requests, -1, *t.shape[2:]) for t in (q, k, v))  # [R, T / R, h, D]
    s.on_kv(k, v)
    past_k, past_v = s.past
    if past_k.shape[1] > 0:
        k = torch.cat((past_k, k), dim=1)
        v = torch.cat((past_v, v), dim=1)
    out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), s.mask)  # [R, heads, T / R, D]
    return out.transpose(0, 1).reshape(1, out.shape[1], -1, out.shape[3])


QUERY_TILE = 16  # attend_rows_exact: queries go through products of this many rows
KEY_GRANULE = 8  # ... and keys in multiples of this (a product over 1 key changed with the batch)

def row_groups(lengths: Sequence[int], device: torch.device) -> tuple[RowGroup, ...]:
    """A segment's rows grouped by length, for attend_rows_exact: found once per forward, not per
    layer."""
    groups = []
    for n in sorted(set(lengths)):
        rows = [r for r, length in enumerate(lengths) if length == n]
        index = slice(None) if len(rows) == len(lengths) else torch.tensor(rows, device=device)
        groups.append((n, index))
    return tuple(groups)


def attend_rows_exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: LayerSegment) -> torch.Tensor:
    """attend_with_past for rows [R, W, heads | kv_heads, D] grouped by real length (s.row_groups),
    each row's bits its own: SDPA's CPU kernel gives a query other bits with the number of queries
    and (masked) keys of its call and with the thread count, so one request's rows split over
    several workers (each padding its rows to its own width, with its own threads) decoded otherwise
    than on one. Here a row attends without padding, its queries in tiles of QUERY_TILE and its keys
    padded to a multiple of KEY_GRANULE (shapes that follow from the row alone), through two bmm
    whose every product has that shape; rows of equal length share the calls. Returns
    [R, heads, W, D] (zeros at padded queries)."""
    assert s.row_groups is not None and s.mask is not None
    if s.on_kv is not None:
        s.on_kv(k, v)
    rows, width, heads, dim = q.shape
    past_k, past_v = s.past if s.past is not None else (k[0, :0], v[0, :0])
    cached = past_k.shape[0]
    out = q.new_zeros(rows, heads, width, dim)
    for n, index in s.row_groups:
        size = rows if isinstance(index, slice) else len(index)
        keys = torch.cat((past_k.unsqueeze(0).expand(size, -1, -1, -1), k[index, :n]), dim=1)
        values = torch.cat((past_v.unsqueeze(0).expand(size, -1, -1, -1), v[index, :n]), dim=1)
        mask = s.mask[index, 0]
        # block_causal: the head's keys are the cache and the head itself (the rest is masked anyway)
        spans = ((0, s.head), (s.head, n)) if 0 < s.head < n else ((0, n),)
        for lo, hi in spans:
            seen = cached + (hi if lo == 0 else n)
            part = _attend_tiles(q[index, lo:hi], keys[:, :seen], values[:, :seen], mask[:, lo:hi, :seen])
            out[index, :, lo:hi] = part
    return out


def _attend_tiles(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax attention of q [G, T, heads, D] over k, v [G, N, kv_heads, D] under the additive mask
    [G, T, N]; [G, heads, T, D]. Every product is [QUERY_TILE, D] x [D, N'] or [QUERY_TILE, N'] x
    [N', D], N' = N rounded up to KEY_GRANULE: a query's bits depend on its own row's keys only."""
    group, queries, heads, dim = q.shape
    n = k.shape[1]
    tiles = -(-queries // QUERY_TILE)
    padded_q, padded_n = tiles * QUERY_TILE, -(-n // KEY_GRANULE) * KEY_GRANULE
    q = F.pad(q, (0, 0, 0, 0, 0, padded_q - queries))
    k, v = (F.pad(t, (0, 0, 0, 0, 0, padded_n - n)) for t in (k, v))
    mask = F.pad(mask, (0, padded_n - n), value=float("-inf"))
    mask = F.pad(mask, (0, 0, 0, padded_q - queries))  # padded queries see every key: no NaN
    repeat = heads // k.shape[2]  # GQA: head h reads KV head h // repeat
    k, v = (t.transpose(1, 2).repeat_interleave(repeat, dim=1) for t in (k, v))  # [G, heads, N', D]
    q = q.transpose(1, 2).reshape(group, heads, tiles, QUERY_TILE, dim)
    batch = group * heads * tiles
    scores = torch.bmm(
        (q * dim**-0.5).reshape(batch, QUERY_TILE, dim),
        k.transpose(2, 3).unsqueeze(2).expand(-1, -1, tiles, -1, -1).reshape(batch, dim, padded_n),
    ).view(group, heads, tiles, QUERY_TILE, padded_n)
    scores = scores + mask.view(group, 1, tiles, QUERY_TILE, padded_n)
    probs = torch.softmax(scores, dim=-1).reshape(batch, QUERY_TILE, padded_n)
    out = torch.bmm(probs, v.unsqueeze(2).expand(-1, -1, tiles, -1, -1).reshape(batch, padded_n, dim))
    return out.view(group, heads, padded_q, dim)[:, :, :queries]


def attend_with_past(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    past: tuple[torch.Tensor, torch.Tensor] | None,
    on_kv: Callable[[torch.Tensor, torch.Tensor], None] | None,
) -> torch.Tensor:
    """Attention of [B, T, heads, D] queries over the cached prefix and the [B, T, kv_heads, D]
    window keys/values (staged first through on_kv); returns [B, heads, T, D]."""
    batch = q.shape[0]
    if on_kv is not None:
        on_kv(k, v)
    if past is not None and past[0].shape[0] > 0:
        # The cached prefix is shared by every row: put in front of each row's window. Folded
        # (batch == 1) it is copied once; row by row (CPU) once per row, R x C x kv_heads x D
        # values per layer, small beside the scores, which are ~W x heads / kv_heads times more.
        past_k, past_v = past
        k = torch.cat((past_k.unsqueeze(0).expand(batch, -1, -1, -1), k), dim=1)
        v = torch.cat((past_v.unsqueeze(0).expand(batch, -1, -1, -1), v), dim=1)
    return attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA over [B, heads, T, D] queries and [B, kv_heads, S, D] keys/values; GQA natively (head h
    uses KV head h // (heads / kv_heads)), never by materialising repeated KV heads. With a mask,
    CUDA runs this on the cuDNN kernel (measured on an H100 with torch 2.11: the fastest of cuDNN,
    memory-efficient with repeated KV, and flex attention for these shapes)."""
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def bind(on_kv: KVCallback, index: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
    return lambda k, v: on_kv(index, k, v)


def bind_segments(
    segments: Sequence[Segment] | UniformSegments | None, index: int
) -> Sequence[LayerSegment] | LayerUniform | None:
    if segments is None:
        return None
    if isinstance(segments, UniformSegments):
        on_kv = bind(segments.on_kv, index)
        return LayerUniform(segments.requests, segments.mask, segments.past(index), on_kv)
    return [bind_segment(s, index) for s in segments]


def bind_segment(segment: Segment, index: int) -> LayerSegment:
    past = segment.past.cached(index) if segment.past is not None else None
    on_kv = None if segment.on_kv is None else bind(segment.on_kv, index)
    return LayerSegment(
        segment.begin, segment.end, segment.mask, past, on_kv, segment.rows, segment.row_groups, segment.head
    )
