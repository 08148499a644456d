"""The lm_head and a round's statistics in one pass over the vocabulary.

What the decoder reads of a masked position is three numbers (lopa.execution.sampling): the token
x_hat, its probability P and the confidence Conf. Greedily (temperature 0, no top-p / top-k),
those are the argmax of the logits, 1 / sum(exp(logit - max)) and, for Conf, P itself, the negative
entropy sum(p log p) or the margin top1 - top2. The reference computes every logit of every masked
position ([N, vocab] fp32, 152k columns for a 7B), then a softmax over them, a max and a sum: several
passes over N x vocab values. The kernel multiplies the hidden states by the lm_head tile by tile
and keeps, per row, a running maximum, its index, the second largest logit, sum(exp(l - max)) and
sum(exp(l - max) (l - max)): the logits never reach memory. The vocabulary is split into chunks
of a fixed width (programs enough to keep every SM reading the weight); a second kernel merges the
chunks in order, so a row's statistics do not depend on the rows beside it.

Serves: greedy statistics of any number of rows and any vocabulary; lm_head weights in the model
dtype or FP8 (e4m3 + per-row scales). Arithmetic: logits accumulated in fp32 (the reference rounds
them to the model dtype first), the statistics in fp32. The negative entropy is sum(p log p) where
the reference adds 1e-10 inside the log: they differ by at most vocab x 1e-10 (1.5e-5 for a 7B).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lopa.kernels.fp8 import linear_reference
from lopa.kernels.triton_support import cdiv, interpreting, kernel, next_power_of_two, tl
from lopa.params import ConfKind

ENTROPY_EPS = 1e-10  # lopa.execution.sampling's
VOCAB_CHUNK = 1024  # vocabulary columns per program of the first kernel
CONF_CODES = {ConfKind.PROB: 0, ConfKind.NEG_ENTROPY: 1, ConfKind.MARGIN: 2}
Stats = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # x_hat [N] int64, P [N] fp32, Conf [N] fp32


def greedy_stats_reference(
    hidden: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, conf: ConfKind
) -> Stats:
    """hidden [N, H] -> the greedy statistics of each row's logits (hidden @ weight.T), computed
    as lopa.execution.sampling.position_stats computes them from those logits."""
    logits = linear_reference(hidden, weight, scale) if scale is not None else F.linear(hidden, weight)
    probs = torch.softmax(logits.float(), dim=-1)
    chosen, tokens = probs.max(dim=-1)
    if conf is ConfKind.PROB:
        return tokens, chosen, chosen
    if conf is ConfKind.NEG_ENTROPY:
        return tokens, chosen, (probs * torch.log(probs + ENTROPY_EPS)).sum(dim=-1)
    top2 = torch.topk(probs, 2, dim=-1).values
    return tokens, chosen, top2[..., 0] - top2[..., 1]


def serves(vocab: int) -> bool:
    return vocab >= 2


@kernel
def _vocab_partials(
    hidden_ptr, weight_ptr, scale_ptr, top_ptr, second_ptr, total_ptr, moment_ptr, index_ptr,
    rows, vocab, width, hidden_stride, chunk,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_SCALE: tl.constexpr, DOT_FP32: tl.constexpr,
):
    # long: one Triton kernel: split, it would cost a launch and a pass over memory
    row = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    part = tl.program_id(1)
    depth = tl.arange(0, BLOCK_K)
    top = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    second = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_N,), tl.float32)  # sum exp(l - top)
    moment = tl.zeros((BLOCK_N,), tl.float32)  # sum exp(l - top) (l - top)
    index = tl.zeros((BLOCK_N,), tl.int64)
    for begin in range(part * chunk, part * chunk + chunk, BLOCK_V):
        column = begin + tl.arange(0, BLOCK_V)
        valid = column < vocab
        logits = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
        for offset in range(0, width, BLOCK_K):
            ks = offset + depth
            h = tl.load(hidden_ptr + row[:, None] * hidden_stride + ks[None, :],
                        mask=(row[:, None] < rows) & (ks[None, :] < width), other=0.0)
            w = tl.load(weight_ptr + column[None, :] * width + ks[:, None],
                        mask=valid[None, :] & (ks[:, None] < width), other=0.0)
            if DOT_FP32:
                logits += tl.dot(h.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                logits += tl.dot(h, w.to(h.dtype))
        if HAS_SCALE:
            logits = logits * tl.load(scale_ptr + column, mask=valid, other=0.0)[None, :]
        logits = logits.to(hidden_ptr.dtype.element_ty).to(tl.float32)  # rounded as the lm_head's are
        logits = tl.where(valid[None, :], logits, float("-inf"))
        tile_top = tl.max(logits, axis=1)
        tile_arg = tl.argmax(logits, axis=1)
        at_top = tl.arange(0, BLOCK_V)[None, :] == tile_arg[:, None]
        tile_second = tl.max(tl.where(at_top, float("-inf"), logits), axis=1)
        # a tile past the vocabulary is all -inf: shifted from 0 instead (no -inf - -inf)
        base = tl.where(tile_top == float("-inf"), 0.0, tile_top)
        shifted = tl.where(valid[None, :], logits - base[:, None], 0.0)
        weights = tl.where(valid[None, :], tl.exp(shifted), 0.0)
        tile_total = tl.sum(weights, axis=1)
        tile_moment = tl.sum(weights * shifted, axis=1)
        # merged with the running values (a tile past the vocabulary, all -inf, adds nothing)
        merged = tl.maximum(top, tile_top)
        old_shift = tl.where(top == float("-inf"), 0.0, top - merged)
        new_shift = tl.where(tile_top == float("-inf"), 0.0, base - merged)
        old_scale = tl.exp(old_shift)
        new_scale = tl.where(tile_top == float("-inf"), 0.0, tl.exp(new_shift))
        moment = old_scale * (moment + total * old_shift) + new_scale * (tile_moment + tile_total * new_shift)
        total = old_scale * total + new_scale * tile_total
        second = tl.maximum(tl.minimum(top, tile_top), tl.maximum(second, tile_second))
        index = tl.where(tile_top > top, begin + tile_arg.to(tl.int64), index)
        top = merged
    keep = row < rows
    at = part * rows + row
    tl.store(top_ptr + at, top, mask=keep)
    tl.store(second_ptr + at, second, mask=keep)
    tl.store(total_ptr + at, total, mask=keep)
    tl.store(moment_ptr + at, moment, mask=keep)
    tl.store(index_ptr + at, index, mask=keep)


@kernel
def _vocab_merge(
    top_ptr, second_ptr, total_ptr, moment_ptr, index_ptr, tokens_ptr, prob_ptr, conf_ptr,
    rows, parts, BLOCK_N: tl.constexpr, CONF: tl.constexpr,
):
    row = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = row < rows
    top = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    second = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_N,), tl.float32)
    moment = tl.zeros((BLOCK_N,), tl.float32)
    index = tl.zeros((BLOCK_N,), tl.int64)
    for part in range(0, parts):  # in order: ties go to the first chunk, as the reference's max
        at = part * rows + row
        part_top = tl.load(top_ptr + at, mask=keep, other=0.0)
        part_second = tl.load(second_ptr + at, mask=keep, other=0.0)
        part_total = tl.load(total_ptr + at, mask=keep, other=1.0)
        part_moment = tl.load(moment_ptr + at, mask=keep, other=0.0)
        part_index = tl.load(index_ptr + at, mask=keep, other=0)
        merged = tl.maximum(top, part_top)
        old_shift = tl.where(top == float("-inf"), 0.0, top - merged)
        new_shift = part_top - merged
        old_scale, new_scale = tl.exp(old_shift), tl.exp(new_shift)
        moment = old_scale * (moment + total * old_shift) + new_scale * (part_moment + part_total * new_shift)
        total = old_scale * total + new_scale * part_total
        second = tl.maximum(tl.minimum(top, part_top), tl.maximum(second, part_second))
        index = tl.where(part_top > top, part_index, index)
        top = merged
    prob = 1.0 / total
    if CONF == 0:
        conf = prob
    elif CONF == 1:
        conf = moment / total - tl.log(total)
    else:
        conf = (1.0 - tl.exp(second - top)) / total
    tl.store(tokens_ptr + row, index, mask=keep)
    tl.store(prob_ptr + row, prob, mask=keep)
    tl.store(conf_ptr + row, conf, mask=keep)


@dataclass(frozen=True)
class Partials:
    """Per chunk of the vocabulary and row: its largest logit, second largest, sum(exp(l - top)),
    sum(exp(l - top) (l - top)) ([4, parts, rows] fp32) and the largest one's token ([parts, rows])."""

    values: torch.Tensor
    index: torch.Tensor


def partials(
    hidden: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, block_v: int = 128,
    parts: int | None = None,
) -> Partials:
    """The first kernel: the lm_head chunk by chunk, each reduced to its Partials (`parts`
    overrides how many chunks the vocabulary is split into)."""
    rows, width = hidden.shape
    vocab = weight.shape[0]
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    block_n = min(64, max(16, next_power_of_two(rows)))
    row_tiles = cdiv(rows, block_n)
    # A fixed chunk, whatever the rows: a row's statistics are merged in the same order in any
    # batch (149 chunks for a 7B's vocabulary: programs for every SM even for one row tile).
    chunk = cdiv(cdiv(vocab, parts), block_v) * block_v if parts else cdiv(VOCAB_CHUNK, block_v) * block_v
    parts = cdiv(vocab, chunk)  # every chunk holds a column
    values = torch.empty((4, parts, rows), dtype=torch.float32, device=hidden.device)
    index = torch.empty((parts, rows), dtype=torch.long, device=hidden.device)
    if rows:
        _vocab_partials[(row_tiles, parts)](
            hidden, weight, scale if scale is not None else hidden, *values, index,
            rows, vocab, width, hidden.stride(0), chunk,
            BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_K=64, HAS_SCALE=scale is not None,
            DOT_FP32=interpreting() or hidden.dtype == torch.float32,
        )
    return Partials(values, index)


def merge(found: Partials, conf: ConfKind) -> Stats:
    """The second kernel: the chunks merged in order into each row's statistics."""
    parts, rows = found.index.shape
    device = found.index.device
    tokens = torch.empty(rows, dtype=torch.long, device=device)
    probs = torch.empty(rows, dtype=torch.float32, device=device)
    confs = torch.empty_like(probs)
    if rows:
        block_n = min(64, max(16, next_power_of_two(rows)))
        _vocab_merge[(cdiv(rows, block_n),)](*found.values, found.index, tokens, probs, confs, rows, parts,
                                             BLOCK_N=block_n, CONF=CONF_CODES[conf])
    return tokens, probs, confs


def greedy_stats(
    hidden: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, conf: ConfKind,
    block_v: int = 128, parts: int | None = None,
) -> Stats:
    """greedy_stats_reference in two Triton kernels (see the module docstring)."""
    return merge(partials(hidden, weight, scale, block_v, parts), conf)
