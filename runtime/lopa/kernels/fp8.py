"""FP8 weights: e4m3 values with one fp32 scale per output channel, and the reference product.

A weight [N, K] is stored as e4m3 [N, K] (one byte a value: half of bf16) and scales [N]: row n is
w[n] / scale[n], rounded to e4m3, with scale[n] = max |w[n]| / E4M3_MAX, so every row uses the
format's whole range. Quantized at load from the checkpoint's weights (after a LoRA adapter is
merged into them: the merged weight is what gets rounded).

The reference product upcasts: x @ (e4m3 * scale).T in the activations' dtype. The CPU always runs
it (through lopa.model.invariant's batch-invariant product); a GPU runs a kernel of
lopa.kernels.fp8_products, which scales after the accumulation instead (the same product up to
rounding).

Error of the format: e4m3 keeps 3 mantissa bits, so a weight moves by at most 1/16 of its own
magnitude (relative), 1/32 on average; per-channel scales keep small rows from losing their bits to
a large one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (e4m3 [N, K], fp32 scales [N]); a row of zeros gets scale 1."""
    values = weight.float()
    largest = values.abs().amax(dim=1)
    scale = torch.where(largest > 0, largest / E4M3_MAX, torch.ones_like(largest))
    quantized = (values / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return quantized, scale


def dequantize(quantized: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 [N, K] and scales [N] -> the weight [N, K] in `dtype`."""
    return (quantized.float() * scale[:, None]).to(dtype)


def linear_reference(
    x: torch.Tensor, quantized: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ dequantize(quantized, scale).T (+ bias), in x's dtype."""
    return F.linear(x, dequantize(quantized, scale, x.dtype), bias)
