"""SiLU(gate) x up: the MLP's activation, read straight from the fused gate/up product's output.

Where the model uses it: between a layer's gate/up product and its down product
(lopa.model.layer_steps.swiglu). The reference is two kernels on a GPU (silu, the product); the
Triton kernel reads gate and up where the fused product left them (the two halves of each row, no
chunk copies) and writes the product once.

Serves: any shape; gate and up of one row shape, each with unit stride along the last dimension.
Arithmetic: silu in fp32, rounded to the model dtype (as the reference's silu), the product in fp32
rounded once: the reference's bits in fp32, within one unit of the last place in bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lopa.kernels.triton_support import cdiv, kernel, tl

ROW_BLOCK, BLOCK = 4, 512  # rows and columns per program


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@kernel
def _swiglu(gate_ptr, up_ptr, out_ptr, rows, width, gate_stride, up_stride,
            ROW_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    row = (tl.program_id(0) * ROW_BLOCK + tl.arange(0, ROW_BLOCK))[:, None]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    inside = (row < rows) & (cols < width)
    gate = tl.load(gate_ptr + row * gate_stride + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * up_stride + cols, mask=inside, other=0.0).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (activated * up).to(out_ptr.dtype.element_ty), mask=inside)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """swiglu_reference as one Triton kernel (output contiguous, shaped as gate)."""
    width = gate.shape[-1]
    flat_gate, flat_up = _rows(gate), _rows(up)
    rows = flat_gate.shape[0]
    out = torch.empty((rows, width), dtype=gate.dtype, device=gate.device)
    if rows:
        _swiglu[(cdiv(rows, ROW_BLOCK), cdiv(width, BLOCK))](
            flat_gate, flat_up, out, rows, width, flat_gate.stride(0), flat_up.stride(0),
            ROW_BLOCK=ROW_BLOCK, BLOCK=BLOCK,
        )
    return out.view(gate.shape)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, width] with unit stride along width: the halves of a fused [.., 2 x width] output
    stay views (their rows are evenly spaced), anything else is copied."""
    flat = t.reshape(-1, t.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()
