"""The boolean attention mask of one verification forward (pure function, unit-tested)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lopa.params import AttentionMode


def build_window_mask(
    lengths: Sequence[int],
    block_ids: torch.Tensor,
    cache_length: int,
    mode: AttentionMode | str,
) -> torch.Tensor:
    """Bool mask [R, 1, L, C+L] (True = may attend) over C cached keys followed by L window keys.

    - cached keys are visible to every query in both modes: the cache only ever holds complete
      blocks that precede the window;
    - window key k is visible to query q of row r iff k < lengths[r] (padding is masked) and, in
      block_causal mode, block_ids[r, k] <= block_ids[r, q];
    - every query sees itself, so padded queries never have an all-masked row: softmax over nothing
      would give NaN, and a NaN value in a padded position poisons the other rows through 0 * NaN.
    """
    mode = AttentionMode(mode)
    rows, length = block_ids.shape
    if len(lengths) != rows:
        raise ValueError(f"{len(lengths)} lengths for {rows} rows")
    device = block_ids.device
    index = torch.arange(length, device=device)
    valid_key = index[None, :] < torch.as_tensor(list(lengths), device=device)[:, None]  # [R, L]
    window = valid_key[:, None, :].expand(rows, length, length)  # [R, query, key]
    if mode is AttentionMode.BLOCK_CAUSAL:
        window = window & (block_ids[:, None, :] <= block_ids[:, :, None])
    window = window | torch.eye(length, dtype=torch.bool, device=device)
    cached = torch.ones(rows, length, cache_length, dtype=torch.bool, device=device)
    return torch.cat((cached, window), dim=2).unsqueeze(1)
