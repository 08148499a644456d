"""The attention mask of one verification forward (pure tensor functions, unit-tested).

A forward folds its R rows (one per branch, each L tokens, padded) into ONE sequence of R * L
queries, so that every row reads the shared cache once, without copying it per row. The keys are
the W cache positions followed by the R * L window tokens:

- cache position c is visible to every query iff c < cache_length (W may exceed the cache length:
  a captured CUDA graph reads a fixed width, the unused tail is masked);
- window token k of row r' is visible to query q of row r iff r' == r, k < lengths[r] (padding is
  masked) and, in block_causal mode, block_ids[r, k] <= block_ids[r, q];
- every query sees itself, so padded queries never have an all-masked row: softmax over nothing
  would give NaN, and a NaN value in a padded position poisons the other rows through 0 * NaN.

On CPU the rows attend one by one instead (`row_masks`: R masks over the cache and the row's own
keys): each row then skips the other rows' keys, all masked anyway, and its bits no longer depend
on how many rows share its forward or where it sits among them (folded, a row's logits moved in the
last bits with its position, so one request split over 2 workers could differ from it on one).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from lopa.params import AttentionMode


def window_mask(
    lengths: torch.Tensor,
    block_ids: torch.Tensor,
    cache_length: torch.Tensor,
    cache_width: int,
    block_causal: torch.Tensor,
) -> torch.Tensor:
    """Bool mask [1, 1, R*L, W + R*L] (True = may attend), from tensors only (no host sync, so a CUDA
    graph can capture it): lengths [R], block_ids [R, L], cache_length and block_causal 0-dim."""
    return window_masks(lengths[None], block_ids[None], cache_length[None], cache_width, block_causal[None])


def window_masks(
    lengths: torch.Tensor,
    block_ids: torch.Tensor,
    cache_lengths: torch.Tensor,
    cache_width: int,
    block_causal: torch.Tensor,
) -> torch.Tensor:
    """window_mask of N requests of equal shape at once, [N, 1, R*L, W + R*L]: lengths [N, R],
    block_ids [N, R, L], cache_lengths and block_causal [N] (a batched CUDA-graph round builds
    every request's mask with the same ~15 kernels, not 15 per request)."""
    requests, rows, length = block_ids.shape
    device = block_ids.device
    index = torch.arange(length, device=device)
    valid_key = index < lengths[..., None]  # [N, R, L]
    causal = block_causal[:, None, None, None]
    later = block_ids[:, :, None, :] <= block_ids[:, :, :, None]  # [N, R, query, key]
    own = valid_key[:, :, None, :] & (later | ~causal)
    own = own | torch.eye(length, dtype=torch.bool, device=device)  # [N, R, query, key]
    same_row = torch.eye(rows, dtype=torch.bool, device=device)  # [R, R']
    window = same_row[None, :, None, :, None] & own[:, :, :, None, :]  # [N, R, query, R', key]
    tokens = rows * length
    visible = torch.arange(cache_width, device=device) < cache_lengths[:, None]  # [N, W]
    cached = visible[:, None, :].expand(requests, tokens, cache_width)
    return torch.cat((cached, window.reshape(requests, tokens, tokens)), dim=2)[:, None]


def build_window_mask(
    lengths: Sequence[int],
    block_ids: torch.Tensor,
    cache_length: int,
    mode: AttentionMode | str,
    cache_width: int | None = None,
) -> torch.Tensor:
    """window_mask from host values; cache_width defaults to the cache length."""
    mode = AttentionMode(mode)
    rows = block_ids.shape[0]
    if len(lengths) != rows:
        raise ValueError(f"{len(lengths)} lengths for {rows} rows")
    width = cache_length if cache_width is None else cache_width
    if width < cache_length:
        raise ValueError(f"cache_width {width} < cache_length {cache_length}")
    device = block_ids.device
    return window_mask(
        torch.as_tensor(list(lengths), device=device),
        block_ids,
        torch.tensor(cache_length, device=device),
        width,
        torch.tensor(mode is AttentionMode.BLOCK_CAUSAL, device=device),
    )


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bool mask as 0 / -inf in dtype: converted once per forward rather than by every layer's
    attention call."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


_MEMO_TOKENS = 512  # windows up to this many tokens keep their mask (<= 1 MiB each in fp32)


def additive_window_mask(
    lengths: Sequence[int],
    block_ids: torch.Tensor,
    cache_length: int,
    mode: AttentionMode | str,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    by_row: bool = False,
) -> torch.Tensor:
    """additive(build_window_mask(...)), or with by_row additive(row_masks(...)), on `device`
    (block_ids on the host), the window part memoized: a request's rounds repeat a few window
    shapes while its cache grows, and a batched round builds one mask per request, so rebuilding
    it (~20 small ops) was a visible share of an eager CPU forward. Same values."""
    device = torch.device(device)
    rows, width = block_ids.shape
    if len(lengths) != rows:
        raise ValueError(f"{len(lengths)} lengths for {rows} rows")
    causal = AttentionMode(mode) is AttentionMode.BLOCK_CAUSAL
    if rows * width > _MEMO_TOKENS:
        own = additive(_window(tuple(lengths), block_ids.to(device), causal, by_row), dtype)
    else:  # full attention ignores the block ids: the rows, width and lengths decide the mask
        ids = tuple(block_ids.flatten().tolist()) if causal else None
        own = _memo_window(rows, width, tuple(lengths), ids, by_row, dtype, device)
    queries, keys = own.shape[-2:]
    mask = torch.empty((own.shape[0], 1, queries, cache_length + keys), dtype=dtype, device=device)
    mask[..., :cache_length] = 0
    mask[..., cache_length:] = own
    return mask


def row_masks(
    lengths: torch.Tensor, block_ids: torch.Tensor, cache_length: int, block_causal: bool
) -> torch.Tensor:
    """Bool masks [R, 1, L, cache_length + L], one per row, for attention computed row by row:
    query q of row r sees every cached position and its own row's key k iff k < lengths[r] and, in
    block_causal mode, block_ids[r, k] <= block_ids[r, q]; every query sees itself. The same
    visibility as window_mask's diagonal blocks, without the other rows' (always masked) keys."""
    rows, length = block_ids.shape
    device = block_ids.device
    valid_key = torch.arange(length, device=device)[None, :] < lengths[:, None]  # [R, L]
    own = valid_key[:, None, :]
    if block_causal:
        own = own & (block_ids[:, None, :] <= block_ids[:, :, None])
    own = own | torch.eye(length, dtype=torch.bool, device=device)  # [R, query, key]
    cached = torch.ones((rows, length, cache_length), dtype=torch.bool, device=device)
    return torch.cat((cached, own), dim=2)[:, None]


def _window(lengths: tuple[int, ...], block_ids: torch.Tensor, causal: bool, by_row: bool) -> torch.Tensor:
    """The window part of the bool mask: [1, 1, T, T] folded or [R, 1, L, L] by row."""
    if by_row:
        return row_masks(torch.tensor(lengths, device=block_ids.device), block_ids, 0, causal)
    mode = AttentionMode.BLOCK_CAUSAL if causal else AttentionMode.FULL
    return build_window_mask(lengths, block_ids, 0, mode)


@functools.lru_cache(maxsize=128)
def _memo_window(
    rows: int,
    width: int,
    lengths: tuple[int, ...],
    ids: tuple[int, ...] | None,
    by_row: bool,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    if ids is None:
        block_ids = torch.zeros(rows, width, dtype=torch.long)
    else:
        block_ids = torch.tensor(ids).view(rows, width)
    return additive(_window(lengths, block_ids.to(device), ids is not None, by_row), dtype)
