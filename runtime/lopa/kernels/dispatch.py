"""Which implementation runs: a Triton kernel or its torch reference, per device and shape.

The CPU always runs the references: its row-exact bits (lopa.model.invariant, exact attention)
depend on them. On CUDA, with Triton installed, each step runs its kernel where the kernel serves
the shape (each kernel module says which), else its reference. LOPA_KERNELS chooses:

- `triton` (the default): the kernels on CUDA, the references elsewhere;
- `torch`: the references everywhere (the way out should a kernel misbehave on some GPU);
- `interpret`: the kernels on the CPU as well, through Triton's interpreter. For tests only: it is
  slow, and it gives up the CPU's row-exact bits.
"""

from __future__ import annotations

import torch

from lopa import performance
from lopa.kernels.triton_support import available

KERNELS_ENV = performance.ENV["kernels"]
TRITON, TORCH, INTERPRET = performance.TRITON, performance.TORCH, performance.INTERPRET
MODES = performance.KERNEL_MODES


def mode() -> str:
    """The kernels switch (lopa.performance); ValueError naming it when it is none of MODES."""
    return str(performance.value("kernels"))


def uses_triton(device: torch.device) -> bool:
    """Whether the steps on `device` run their Triton kernels (where they serve the shape)."""
    if not available():
        return False
    chosen = mode()
    if device.type == "cuda":
        return chosen in (TRITON, INTERPRET)
    return device.type == "cpu" and chosen == INTERPRET
