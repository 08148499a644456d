"""A worker's share of a step: its branches in one batched forward, per-branch staging slots.

Transport-free: the worker feeds it decoded step messages and a `Broadcast` callable.
Commits follow algorithm.md section 5:
  - full attention: the winner's rank packs all layers' K/V of the committed range plus the
    stored last logit into ONE byte buffer; one broadcast; every rank appends it;
  - block_causal: every rank's own staged K/V (slot 0) is already the committed content.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from lopa.decoding.executor import BranchWindow
from lopa.decoding.rules import PositionStat
from lopa.execution.local import LocalExecutor
from lopa.model.window import DreamWindowModel
from lopa.params import DecodingParams

# broadcast(buffer, src): in-place broadcast of a uint8 tensor from rank src (a collective).
Broadcast = Callable[[torch.Tensor, int], None]


class ShardExecutor(LocalExecutor):
    """A LocalExecutor over this worker's candidates, plus the distributed commit."""

    def __init__(self, model: DreamWindowModel, rank: int, broadcast: Broadcast, pad_id: int = 0) -> None:
        super().__init__(model, device=model.device, pad_id=pad_id)
        self.window_model = model
        self.rank = rank
        self.broadcast = broadcast
        self._received: torch.Tensor | None = None

    def begin_shard(self, params: DecodingParams, num_slots: int) -> None:
        self.begin(params, max(1, num_slots))

    def verify_shard(
        self, start: int, n_stage: int, windows: Sequence[BranchWindow]
    ) -> list[list[PositionStat]]:
        """Verify this worker's rows; with none, stage nothing (the commit will bring the K/V)."""
        if not windows:
            self.drop_staged()
            return []
        return self.verify(start, n_stage, windows)

    def commit_shard(self, n: int, winner_rank: int, winner_slot: int, broadcast: bool) -> None:
        if n == 0:
            self.drop_staged()
            return
        if not broadcast:
            self._commit_own(n)
            return
        kv = self.window_model.kv
        vocab = self.window_model.vocab_size
        kv_bytes = _nbytes(kv.packed_shape(n), kv.dtype)
        if winner_rank == self.rank:
            buffer = self.pack(winner_slot, n)
            self.broadcast(buffer, winner_rank)
            self.commit(winner_slot)  # the winner appends from its own slot: same bytes
            return
        buffer = self._receive_buffer(kv_bytes + vocab * 4)
        self.broadcast(buffer, winner_rank)
        packed = buffer[:kv_bytes].view(kv.dtype).view(kv.packed_shape(n))
        kv.append_packed(packed, n)
        self.state().last_logit = buffer[kv_bytes:].view(torch.float32).clone()
        self.drop_staged()

    def _receive_buffer(self, size: int) -> torch.Tensor:
        """A reused uint8 buffer of `size` bytes (grown as needed): no allocation per commit. Its bytes
        are copied out (into the cache, the last logit cloned) before the next commit reuses it."""
        if self._received is None or self._received.numel() < size:
            self._received = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self._received[:size]

    def pack(self, slot: int, n: int) -> torch.Tensor:
        """One contiguous uint8 buffer: all layers' K/V of n staged tokens, then the fp32 last logit."""
        state = self.state()
        if n != state.staged_count or state.staged_last is None:
            raise RuntimeError(f"commit of {n} tokens but {state.staged_count} were staged")
        packed = self.window_model.kv.pack_staged(slot, n)
        logit = state.staged_last[slot].to(torch.float32).contiguous()
        return torch.cat([packed.reshape(-1).view(torch.uint8), logit.view(torch.uint8)])

    def _commit_own(self, n: int) -> None:
        """block_causal: every row staged the same TO_CACHE content; take slot 0."""
        staged = self.state().staged_count
        if n != staged:
            raise RuntimeError(f"commit of {n} tokens but {staged} were staged on rank {self.rank}")
        self.commit(0)


def _nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
