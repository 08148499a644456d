"""Shapes and tolerances shared by the kernel tests.

Shapes: the 7B's widths scaled down (hidden 3584 -> 224, intermediate 18944 -> 1184, q/k/v heads
28 / 4 / 4 of 128 -> 7 / 1 / 1 of 32, vocabulary 152064 -> 2376) and ragged row counts from 1 to 256.
"""

from __future__ import annotations

import torch

ROWS = (1, 3, 17, 100, 256)
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 224, 1184, 7, 1, 32, 2376


def bf16_close(got: torch.Tensor, want: torch.Tensor, ulps: int = 2) -> None:
    """Within `ulps` units of bf16's last place (2^-7 relative, at most): the interpreter rounds
    bf16 toward zero where a GPU and torch round to nearest, and the two round at other steps."""
    torch.testing.assert_close(got.float(), want.float(), rtol=ulps * 2**-7, atol=ulps * 2**-9)
