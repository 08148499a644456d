"""DreamWindowModel: the `WindowModel` protocol over a DreamModel and a static KV cache."""

from __future__ import annotations

import torch

from lopa.execution.protocol import WindowBatch
from lopa.model.dream import DreamModel
from lopa.model.kv_cache import KVCache
from lopa.model.mask import build_window_mask


class DreamWindowModel:
    """Runs verification forwards (see lopa.execution.protocol) on a real Dream model."""

    def __init__(self, model: DreamModel, max_length: int, num_slots: int = 1) -> None:
        config = model.config
        if max_length > config.max_position_embeddings:
            raise ValueError(
                f"max_length {max_length} exceeds max_position_embeddings {config.max_position_embeddings}"
            )
        self.model = model.eval()
        self.config = config
        self.vocab_size = config.vocab_size
        self.max_length = max_length
        self.kv = KVCache(
            config.num_hidden_layers,
            config.num_key_value_heads,
            config.head_dim,
            max_length,
            dtype=model.dtype,
            device=model.device,
            num_slots=num_slots,
        )

    @property
    def device(self) -> torch.device:
        return self.model.device

    def reset(self, num_slots: int) -> None:
        self.kv.reset(num_slots)

    def cache_length(self) -> int:
        return self.kv.length

    @torch.no_grad()
    def forward(self, batch: WindowBatch) -> torch.Tensor:
        self._check(batch)
        device = self.device
        tokens = batch.tokens.to(device)
        rows, length = tokens.shape
        mask = build_window_mask(batch.lengths, batch.block_ids.to(device), self.kv.length, batch.mode)
        positions = batch.start + torch.arange(length, device=device)
        self.kv.begin_stage(rows, batch.n_stage, batch.first_slot)
        logits = self.model(tokens, positions, mask, past=self.kv, on_kv=self.kv.stage)
        return logits.float()

    def commit(self, slot: int, n: int) -> None:
        self.kv.commit(slot, n)

    def _check(self, batch: WindowBatch) -> None:
        rows, length = batch.tokens.shape
        if batch.start != self.kv.length:
            raise ValueError(f"window start {batch.start} != cache length {self.kv.length}")
        if batch.start + length > self.max_length:
            raise ValueError(f"window ends at {batch.start + length} > max_length {self.max_length}")
        if tuple(batch.block_ids.shape) != (rows, length) or len(batch.lengths) != rows:
            raise ValueError("tokens, block_ids and lengths disagree on the batch shape")
        for row, n in enumerate(batch.lengths):
            if not max(1, batch.n_stage) <= n <= length:
                raise ValueError(f"row {row}: length {n} outside [max(1, n_stage={batch.n_stage}), {length}]")
