"""The D2F block-wise masked-diffusion objective.

Per row, the generated region is split into blocks; block b is masked with ratio t_b where the
ratios increase with b (later blocks noisier), often with a clean prefix of blocks (as if cached)
and a fully masked suffix (as if freshly appended), which are the states the decoder's block
pipeline produces. The loss is cross-entropy on masked positions, read as the model's family reads
its logits: with the Dream shift the raw output at p-1 predicts token p, without it (LLaDA) the
output at p itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lopa.model.transformer import DiffusionLM
from lopa.training.data import MASK, PAD_BLOCK, Batch


def block_ratios(rows: int, gen_blocks: int, generator: torch.Generator) -> torch.Tensor:
    """[R, gen_blocks] mask ratios, non-decreasing along the blocks of each row."""
    ratios = torch.rand(rows, gen_blocks, generator=generator).sort(dim=1).values
    index = torch.arange(gen_blocks)[None, :]
    clean = torch.randint(0, gen_blocks, (rows, 1), generator=generator)  # blocks before: t = 0
    full = (
        clean + (torch.rand(rows, 1, generator=generator) * (gen_blocks - clean + 1)).long()
    )  # t = 1 from here
    ratios = torch.where(index < clean, torch.zeros_like(ratios), ratios)
    return torch.where(index >= full, torch.ones_like(ratios), ratios)


def noise(batch: Batch, gen_blocks: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(noisy tokens, masked bool [R, L]); every row has at least one masked position."""
    rows, _ = batch.tokens.shape
    ratios = block_ratios(rows, gen_blocks, generator)
    generated = batch.block_ids > 0
    per_position = torch.zeros(batch.tokens.shape)
    block_index = (batch.block_ids - 1).clamp(min=0)
    per_position = torch.where(generated, ratios.gather(1, block_index), per_position)
    masked = (torch.rand(batch.tokens.shape, generator=generator) < per_position) & generated
    # A row with nothing masked teaches nothing: mask its last generated position.
    empty = ~masked.any(dim=1)
    last = (generated.long().cumsum(dim=1) == generated.sum(dim=1, keepdim=True)) & generated
    masked = masked | (empty[:, None] & last)
    return torch.where(masked, torch.full_like(batch.tokens, MASK), batch.tokens), masked


def attention_mask(block_ids: torch.Tensor, full_rows: torch.Tensor) -> torch.Tensor:
    """Bool [R, 1, L, L], True = may attend.

    Block-causal rows: prompt sees prompt, block b sees the prompt and blocks <= b (D2F).
    Full rows: every real token sees every real token (the LoPA default at inference).
    Padding keys are invisible; every query sees itself so no softmax row is empty.
    """
    valid = block_ids != PAD_BLOCK
    causal = block_ids[:, None, :] <= block_ids[:, :, None]
    allowed = valid[:, None, :] & (causal | full_rows[:, None, None])
    allowed = allowed | torch.eye(block_ids.shape[1], dtype=torch.bool)[None]
    return allowed.unsqueeze(1)


def diffusion_loss(
    model: DiffusionLM, batch: Batch, gen_blocks: int, full_fraction: float, generator: torch.Generator
) -> torch.Tensor:
    noisy, masked = noise(batch, gen_blocks, generator)
    rows, length = noisy.shape
    full_rows = torch.rand(rows, generator=generator) < full_fraction
    mask = attention_mask(batch.block_ids, full_rows)
    logits = model(noisy, torch.arange(length), mask)
    # With the shift, output p-1 predicts token p (p >= 1 always holds: position 0 is prompt).
    shift = model.config.logit_shift
    targets = masked[:, shift:]
    predicted = logits[:, : length - shift][targets]
    return F.cross_entropy(predicted.float(), batch.tokens[:, shift:][targets])
