"""One rank's share of a round when several ranks verify the candidates: its rows of every
running request in one ragged forward, and the commits that travel between ranks.

Transport-free: the worker feeds it decoded step messages and a `Broadcast` callable. It drives a
LocalExecutor through that executor's public methods only. Commits follow docs/decoding.md
section 5, for several requests at once:
  - full attention: each winner rank packs, for every request it won, all layers' K/V of the
    committed range plus the stored last logit (with the Dream shift; a model without it stores
    none) into ONE byte buffer; one broadcast per distinct winner rank; every rank appends each
    request's part to that request's cache;
  - block_causal: every rank's own staged K/V (slot 0 of the request) is already the content.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

import torch

from lopa.decoding.executor import PartOutcome, VerifyPart
from lopa.execution.local import LocalExecutor
from lopa.execution.placement import candidates_on
from lopa.model.window import WindowedLM
from lopa.params import DecodingParams

# broadcast(buffer, src): in-place broadcast of a uint8 tensor from rank src (a collective).
Broadcast = Callable[[torch.Tensor, int], None]


@dataclass(frozen=True)
class CommitOrder:
    """One request's winner of the previous round (the same list, in the same order, on every rank)."""

    sequence: int
    n: int
    winner_rank: int
    winner_slot: int
    broadcast: bool


class ShardExecutor:
    """This rank's rows on a LocalExecutor, plus the distributed commits."""

    def __init__(
        self, model: WindowedLM, rank: int, broadcast: Broadcast, pad_id: int = 0, world_size: int = 1
    ) -> None:
        self.model = model
        self.local = LocalExecutor(model, device=model.device, pad_id=pad_id)
        self.rank, self.world_size = rank, world_size
        self.broadcast = broadcast
        self._received: torch.Tensor | None = None

    def begin(
        self, params: DecodingParams, num_rows: int, sequence: int, excluded_ids: Collection[int] = (),
        alternatives: int = 0,
    ) -> None:
        """A request starts in this KV sequence: `num_rows` candidate rows here (this rank's share)."""
        self.local.begin(params, num_rows, sequence, excluded_ids, alternatives)

    def drop_staged(self, sequence: int) -> None:
        self.local.drop_staged(sequence)

    def verify_round(self, parts: Sequence[VerifyPart]) -> list[PartOutcome]:
        """Verify this worker's rows of every part; a part without rows here stages nothing (the
        commit will bring its K/V) and gets no statistics."""
        with_rows = [replace(p, candidates=self.candidates(p)) for p in parts if p.windows]
        for part in parts:
            if not part.windows:
                self.local.drop_staged(part.sequence)
        outcomes = iter(self.local.verify_many(with_rows) if with_rows else [])
        return [next(outcomes) if p.windows else [] for p in parts]

    def candidates(self, part: VerifyPart) -> list[int]:
        """The request-wide index of each of this worker's windows (its staging slots)."""
        return candidates_on(self.rank, len(part.windows), self.world_size, part.sequence)

    def commit_round(self, commits: Sequence[CommitOrder]) -> None:
        """Apply the previous round's winners: local ones first, then one broadcast per winner rank."""
        fused: dict[int, list[CommitOrder]] = {}
        for c in commits:
            if c.n == 0:
                self.local.drop_staged(c.sequence)
            elif not c.broadcast:
                self._commit_own(c)
            else:
                fused.setdefault(c.winner_rank, []).append(c)
        for winner_rank, orders in fused.items():  # dict order: first appearance, same on every rank
            self._broadcast_commits(winner_rank, orders)

    def _broadcast_commits(self, winner_rank: int, orders: list[CommitOrder]) -> None:
        sizes = [self._commit_bytes(c) for c in orders]
        if winner_rank == self.rank:
            buffer = torch.cat([self.pack(c.sequence, c.winner_slot, c.n) for c in orders])
            self.broadcast(buffer, winner_rank)
            for c in orders:
                self.local.commit_many([(c.sequence, c.winner_slot)])  # from its own slot: the same bytes
            return
        buffer = self._receive_buffer(sum(sizes))
        self.broadcast(buffer, winner_rank)
        offset = 0
        for c, size in zip(orders, sizes, strict=True):
            kv = self.model.caches[c.sequence]
            kv_bytes = size - self._logit_bytes
            part = buffer[offset : offset + size]
            kv.append_packed(part[:kv_bytes].view(kv.dtype).view(kv.packed_shape(c.n)), c.n)
            last_logit = part[kv_bytes:].view(torch.float32).clone() if self._logit_bytes else None
            self.local.adopt_commit(c.sequence, last_logit)
            offset += size

    @property
    def _logit_bytes(self) -> int:
        """The stored last logit's share of a commit: fp32 over the vocabulary with the Dream shift."""
        return self.model.vocab_size * 4 if self.model.logit_shift else 0

    def _commit_bytes(self, c: CommitOrder) -> int:
        kv = self.model.caches[c.sequence]
        return _nbytes(kv.packed_shape(c.n), kv.dtype) + self._logit_bytes

    def _receive_buffer(self, size: int) -> torch.Tensor:
        """A reused uint8 buffer of `size` bytes (grown as needed): no allocation per commit. Its bytes
        are copied out (into the caches, the last logits cloned) before the next commit reuses it."""
        if self._received is None or self._received.numel() < size:
            self._received = torch.empty(size, dtype=torch.uint8, device=self.model.device)
        return self._received[:size]

    def pack(self, sequence: int, slot: int, n: int) -> torch.Tensor:
        """One contiguous uint8 buffer: all layers' K/V of n staged tokens, then the fp32 last logit
        (with the Dream shift)."""
        staged = self.local.staged_count(sequence)
        if n != staged or not staged:
            raise RuntimeError(f"sequence {sequence}: commit of {n} tokens but {staged} were staged")
        packed = self.model.caches[sequence].pack_staged(slot, n).reshape(-1).view(torch.uint8)
        if not self._logit_bytes:
            return packed
        logit = self.local.staged_logit(sequence, slot).to(torch.float32).contiguous()
        return torch.cat([packed, logit.view(torch.uint8)])

    def _commit_own(self, c: CommitOrder) -> None:
        """block_causal: every row staged the same TO_CACHE content; take slot 0."""
        staged = self.local.staged_count(c.sequence)
        if c.n != staged:
            raise RuntimeError(
                f"sequence {c.sequence}: commit of {c.n} tokens but {staged} were staged on rank {self.rank}"
            )
        self.local.commit_many([(c.sequence, 0)])


def _nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
