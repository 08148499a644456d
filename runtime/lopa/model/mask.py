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
"""

from __future__ import annotations

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
    rows, length = block_ids.shape
    device = block_ids.device
    index = torch.arange(length, device=device)
    valid_key = index[None, :] < lengths[:, None]  # [R, L]
    own = valid_key[:, None, :] & ((block_ids[:, None, :] <= block_ids[:, :, None]) | ~block_causal)
    own = own | torch.eye(length, dtype=torch.bool, device=device)  # [R, query, key]
    same_row = torch.eye(rows, dtype=torch.bool, device=device)  # [R, R']
    window = same_row[:, None, :, None] & own[:, :, None, :]  # [R, query, R', key]
    cached = (torch.arange(cache_width, device=device) < cache_length).expand(rows * length, cache_width)
    return torch.cat((cached, window.reshape(rows * length, rows * length)), dim=1)[None, None]


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
