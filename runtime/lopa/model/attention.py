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

from lopa.model.exact_attention import RowSpan, attend_row_alone, attend_rows_exact

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

    With `spans` (CPU, see lopa.model.exact_attention), each row attends unpadded through
    products whose shapes follow from the row alone: its bits then depend on that row alone, not
    on the width its executor padded it to, the rows beside it or the thread count; in
    block_causal mode its TO_CACHE head attends apart, to the cache and the head only, so every row
    stages the very same K/V for it."""

    begin: int
    end: int
    mask: torch.Tensor | None
    past: KVSource | None
    on_kv: KVCallback | None
    rows: int = 1
    spans: tuple[RowSpan, ...] | None = None


# layer -> where that layer's window keys and values go, each [T, kv_heads, D] (see UniformSegments)
StagingOf = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class UniformSegments:
    """`requests` requests of equal token count folded into one batch-1 sequence (a CUDA-graph
    bucket pads them so), each attending to its own cache and tokens under its own mask; their
    caches are slices of one tensor, so each layer attends once with batch = request. Per request
    and layer that saves a K and a V concatenation and an attention call: measured on an H100 with a
    7B model, such small kernels were ~9 ms of a 31 ms round of 16 requests.

    The window's keys and values are laid out straight into `staging` (request after request,
    T / requests tokens each), which the round leaves there for its commits: no copy per request
    and layer into each request's own staging."""

    requests: int
    mask: torch.Tensor  # additive [requests, 1, T / requests, C + T / requests]
    past: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # layer -> K, V [requests, C, kv_heads, D]
    staging: StagingOf
    # The forward's N tokens are packed (compact), token n at slot slots[n] of the T-token layout
    # above (the other slots hold zeros, one the padding tokens').
    slots: torch.Tensor


@dataclass(frozen=True)
class LayerUniform:
    """UniformSegments bound to one layer."""

    requests: int
    mask: torch.Tensor
    past: tuple[torch.Tensor, torch.Tensor]
    staging: tuple[torch.Tensor, torch.Tensor]  # K, V [T, kv_heads, D]
    slots: torch.Tensor


@dataclass(frozen=True)
class LayerSegment:
    """A Segment bound to one layer: its cached K/V and its staging callback."""

    begin: int
    end: int
    mask: torch.Tensor | None
    past: tuple[torch.Tensor, torch.Tensor] | None
    on_kv: Callable[[torch.Tensor, torch.Tensor], None] | None
    rows: int = 1
    spans: tuple[RowSpan, ...] | None = None


def attend_segments(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Sequence[LayerSegment]
) -> torch.Tensor:
    """Attention of a folded batch-1 forward, segment by segment (see Segment); [1, heads, T, D]."""
    if segments[0].spans is not None:
        return _attend_segments_exact(q, k, v, segments)
    parts = []
    for s in segments:
        tokens = slice(s.begin, s.end)
        qs, ks, vs = q[:, tokens], k[:, tokens], v[:, tokens]
        if s.rows > 1:  # [1, R * W, h, D] -> [R, W, h, D]: one batch element per row
            qs, ks, vs = (t.reshape(s.rows, -1, *t.shape[2:]) for t in (qs, ks, vs))
        out = attend_with_past(qs, ks, vs, s.mask, s.past, s.on_kv)  # [R, heads, W, D]
        if s.rows > 1:
            out = out.transpose(0, 1).reshape(1, out.shape[1], -1, out.shape[3])
        parts.append(out)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def _attend_segments_exact(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Sequence[LayerSegment]
) -> torch.Tensor:
    """attend_segments with every segment row-exact (CPU): each writes into one [1, T, heads, D]
    output, the layout the output projection reads, so nothing is transposed or concatenated after.
    A lone row (a request's round with no lookahead branch) has no padding to zero and no other
    row: it attends through attend_row_alone, the same products with fewer ops around them."""
    lone = segments[0]
    if len(segments) == 1 and lone.rows == 1 and lone.spans is not None:
        return attend_row_alone(q, k, v, lone.spans, lone.past, lone.on_kv)
    out = q.new_zeros(q.shape)  # zeros at padded queries
    for s in segments:
        tokens = slice(s.begin, s.end)
        qs, ks, vs, outs = (t[0, tokens].view(s.rows, -1, *t.shape[2:]) for t in (q, k, v, out))
        attend_rows_exact(qs, ks, vs, s.spans, s.past, s.on_kv, outs)
    return out.transpose(1, 2)


def attend_uniform(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: LayerUniform, staged: bool = False
) -> torch.Tensor:
    """Attention of a folded batch-1 forward of equal-sized requests (see UniformSegments), one
    batch element per request; [1, heads, N, D] for the N packed tokens. `staged`: k and v are
    already in s.staging at their slots, the rest of it zeros (lopa.kernels.rotary's kernel wrote
    them there)."""
    # Scattered into the padded layout, where each request's block is its own.
    layout = s.requests * s.mask.shape[2]
    q = q.new_zeros((1, layout, *q.shape[2:])).index_copy_(1, s.slots, q)
    if staged:
        k, v = s.staging
    else:
        keys, values = s.staging
        k = keys.zero_().index_copy_(0, s.slots, k[0])
        v = values.zero_().index_copy_(0, s.slots, v[0])
    q, k, v = (t.reshape(s.requests, -1, *t.shape[-2:]) for t in (q, k, v))  # [R, T / R, h, D]
    past_k, past_v = s.past
    if past_k.shape[1] > 0:
        k = torch.cat((past_k, k), dim=1)
        v = torch.cat((past_v, v), dim=1)
    out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), s.mask)  # [R, heads, T / R, D]
    out = out.transpose(0, 1).reshape(1, out.shape[1], -1, out.shape[3])
    return out.index_select(2, s.slots)


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
        return LayerUniform(
            segments.requests, segments.mask, segments.past(index), segments.staging(index), segments.slots
        )
    return [bind_segment(s, index) for s in segments]


def bind_segment(segment: Segment, index: int) -> LayerSegment:
    past = segment.past.cached(index) if segment.past is not None else None
    on_kv = None if segment.on_kv is None else bind(segment.on_kv, index)
    return LayerSegment(
        segment.begin, segment.end, segment.mask, past, on_kv, segment.rows, segment.spans
    )
