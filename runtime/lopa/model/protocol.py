"""The small protocol between executors and models.

A `WindowModel` runs one verification forward: a batch of rows, each a branch's
tokens from the window start (== cache length) to that branch's end. All rows
share the cached prefix. Each row stages the K/V of its first `n_stage` tokens
(the TO_CACHE tokens) into its own staging slot; `commit(slot, n)` appends one
slot's staged K/V to the shared cache. Logits are raw: the model's `logit_shift` says which
position output `i` predicts, `i + 1` (Dream's shift) or `i` itself (LLaDA); the executor reads each
masked position's logits accordingly.

Real models (lopa.model) and synthetic ones (tests.helpers.rule_model) implement the same protocol,
so the executor and decoder are tested against both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from lopa.params import AttentionMode


@dataclass(frozen=True)
class WindowBatch:
    """One batched verification forward.

    tokens:    [R, L] int64; row r is valid for its first lengths[r] entries, the rest is padding
               (masked out as attention keys; its outputs are garbage and must be ignored).
    lengths:   valid tokens per row, each >= n_stage and >= 1.
    block_ids: [R, L] int64 block index of each token (0 = prompt); used by block_causal attention:
               a token of block b sees cached tokens and window tokens of blocks <= b.
    start:     absolute position of window index 0; equals the model's cache length.
               Position ids are start + arange(L).
    n_stage:   u, the number of TO_CACHE tokens at the head of every row; their K/V go to
               staging slot first_slot + r.
    mode:      attention mode.
    first_slot: staging slot of row 0 (non-zero when rows are forwarded one at a time).
    outputs:   flat token indices (row * L + column) whose logits the caller needs; None = all.
               With them the forward returns [N, vocab] (the lm_head runs on N tokens only).
    sequence:  which of the model's sequences (request KV caches, 0 .. max_batch - 1) it extends.
    """

    tokens: torch.Tensor
    lengths: list[int]
    block_ids: torch.Tensor
    start: int
    n_stage: int
    mode: AttentionMode
    first_slot: int = 0
    outputs: tuple[int, ...] | None = None
    sequence: int = 0

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])


def take_outputs(raw: torch.Tensor, batch: WindowBatch) -> torch.Tensor:
    """Full logits [R, L, V] -> what batch.outputs asks for ([N, V], or all of it when None)."""
    if batch.outputs is None:
        return raw
    index = torch.tensor(batch.outputs, dtype=torch.long, device=raw.device)
    return raw.reshape(-1, raw.shape[-1]).index_select(0, index)


class WindowModel(Protocol):
    """A model with one KV cache per sequence that the executors drive (see module docstring)."""

    vocab_size: int
    logit_shift: int  # 1: output i predicts position i + 1; 0: position i
    max_length: int  # longest sequence (prompt + generation) a cache holds
    max_batch: int  # sequences (requests) held at once

    def reset(self, num_slots: int, sequence: int = 0) -> None:
        """Empty a sequence's cache for a new request; make sure at least num_slots staging slots exist."""

    def cache_length(self, sequence: int = 0) -> int:
        """Number of tokens whose K/V are in the sequence's shared cache."""

    def forward(self, batch: WindowBatch) -> torch.Tensor:
        """Raw logits [R, L, vocab] (float), or [N, vocab] for batch.outputs.

        Stages the K/V of row r's first n_stage tokens in slot first_slot + r of batch.sequence.
        """

    def forward_many(self, batches: list[WindowBatch]) -> list[torch.Tensor]:
        """forward() of several sequences (outputs named) in one call; a row's logits must not depend
        on the other batches (see lopa.model.invariant)."""

    def commit(self, slot: int, n: int, sequence: int = 0) -> None:
        """Append the first n staged tokens of `slot` to the sequence's shared cache."""

    def copy_staged(self, source: int, target: int) -> None:
        """Stage in sequence `target`, slot for slot, what the latest forward staged in `source`; both
        caches are empty (a first round that two requests share, lopa.execution.twins)."""
