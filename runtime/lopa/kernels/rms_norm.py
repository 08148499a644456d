"""Residual add + RMSNorm in one pass: the stream x + delta and its norm, each row read once.

Where the model uses it: in the middle of a decoder layer, where the attention output joins the
residual stream and post_attention_layernorm follows (lopa.model.layer_steps.add_rms_norm). The
reference is three kernels on a GPU (the add, the norm's reduction, its scaling); the Triton kernel
is one program per row.

Serves: any number of rows, hidden sizes up to MAX_HIDDEN (a row is one block of registers), the
model's dtypes. Arithmetic: the sum is rounded to the model dtype (as the reference's add), the
norm is computed in fp32 from it and rounded once: within one unit of the last place of the
reference's bf16 output (whose norm rounds before the weight product).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lopa.kernels.triton_support import kernel, next_power_of_two, tl

MAX_HIDDEN = 16384


def add_rms_norm_reference(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x + delta (the residual stream) and its RMS norm (lopa.model.transformer.RMSNorm's arithmetic)."""
    x = x + delta
    return x, F.rms_norm(x, (x.shape[-1],), weight, eps)


def serves(hidden: int) -> bool:
    return hidden <= MAX_HIDDEN


@kernel
def _add_rms_norm(
    x_ptr, delta_ptr, weight_ptr, sum_ptr, normed_ptr,
    hidden, x_stride, delta_stride, eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=inside, other=0.0)
    delta = tl.load(delta_ptr + row * delta_stride + cols, mask=inside, other=0.0)
    total = (x.to(tl.float32) + delta.to(tl.float32)).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * hidden + cols, total, mask=inside)
    value = total.to(tl.float32)
    inverse = 1.0 / tl.sqrt(tl.sum(value * value, axis=0) / hidden + eps)
    weight = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(normed_ptr + row * hidden + cols, (value * inverse * weight).to(normed_ptr.dtype.element_ty),
             mask=inside)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm_reference as one Triton kernel (outputs contiguous, shaped as x)."""
    hidden = x.shape[-1]
    flat_x, flat_delta = _rows(x), _rows(delta)
    rows = flat_x.shape[0]
    total = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    normed = torch.empty_like(total)
    if rows:
        _add_rms_norm[(rows,)](
            flat_x, flat_delta, weight, total, normed,
            hidden, flat_x.stride(0), flat_delta.stride(0), eps, BLOCK=next_power_of_two(hidden),
        )
    return total.view(x.shape), normed.view(x.shape)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, hidden] with unit stride along hidden (a copy only when it has none)."""
    flat = t.reshape(-1, t.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()

