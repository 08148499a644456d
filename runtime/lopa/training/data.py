"""Turning task examples into training rows: prompt, then answer + EOS padded to whole blocks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lopa.bundled.tasks import Example
from lopa.synthetic.tokenizer import special_token_id

EOS = special_token_id("<|endoftext|>")
MASK = special_token_id("<|mask|>")
PAD_BLOCK = -1  # block id of right padding: no query ever sees it


def char_ids(text: str) -> list[int]:
    """The char tokenizer's ids without loading it: printable ASCII maps to code - 32."""
    ids = []
    for ch in text:
        if not 32 <= ord(ch) < 127:
            raise ValueError(f"character {ch!r} is outside the bundled tokenizer's printable range")
        ids.append(ord(ch) - 32)
    return ids


@dataclass(frozen=True)
class Batch:
    tokens: torch.Tensor  # [R, L] clean tokens (right padding = EOS)
    block_ids: torch.Tensor  # [R, L] 0 = prompt, 1.. = generated blocks, PAD_BLOCK = padding
    prompt_lengths: torch.Tensor  # [R]


def encode(example: Example, block_size: int, gen_blocks: int) -> tuple[list[int], list[int]]:
    """Tokens and block ids of one row. EOS fills the generated region, as Dream pads with EOS."""
    prompt = char_ids(example.prompt)
    generated = [*char_ids(example.answer), EOS]
    width = block_size * gen_blocks
    if len(generated) > width:
        raise ValueError(
            f"answer of {len(generated)} tokens does not fit {gen_blocks} blocks of {block_size}"
        )
    generated += [EOS] * (width - len(generated))
    blocks = [0] * len(prompt) + [1 + i // block_size for i in range(width)]
    return prompt + generated, blocks


def make_batch(examples: Sequence[Example], block_size: int, gen_blocks: int) -> Batch:
    rows = [encode(e, block_size, gen_blocks) for e in examples]
    length = max(len(tokens) for tokens, _ in rows)
    tokens = torch.full((len(rows), length), EOS, dtype=torch.long)
    block_ids = torch.full((len(rows), length), PAD_BLOCK, dtype=torch.long)
    for row, (ids, blocks) in enumerate(rows):
        tokens[row, : len(ids)] = torch.tensor(ids)
        block_ids[row, : len(blocks)] = torch.tensor(blocks)
    prompt_lengths = (block_ids == 0).sum(dim=1)
    return Batch(tokens, block_ids, prompt_lengths)
