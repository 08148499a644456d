"""The model's matrix products, whatever the weights' format.

A linear weight is either in the model dtype or FP8 (e4m3 with a scale per output channel,
lopa.model.weight_formats), the scale kept beside it as the module's `weight_scale` buffer. On the
CPU every product goes through lopa.model.invariant (batch-invariant: a row's bits do not depend on
the rows beside it), an FP8 weight upcast first (the reference of lopa.kernels.fp8). On a GPU an
FP8 weight runs the product lopa.kernels.fp8_products picks for its shape.
"""

from __future__ import annotations

import torch
from torch import nn

from lopa.kernels import fp8
from lopa.kernels.fp8_products import fp8_product
from lopa.model import invariant

SCALE = "weight_scale"  # the buffer of an FP8 linear's per-channel scales


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., k] @ weight[n, k].T (+ bias); `scale` given: weight is e4m3 and these its scales."""
    if scale is None:
        return invariant.linear(x, weight, bias)
    if invariant.wanted(x):
        return invariant.linear(x, fp8.dequantize(weight, scale, x.dtype), bias)
    return fp8_product(x, weight, scale, bias)


def scale_of(module: nn.Module) -> torch.Tensor | None:
    return module._buffers.get(SCALE)


def apply(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module(x): a plain nn.Linear through `linear` (a PEFT-wrapped one runs as it is)."""
    if type(module) is nn.Linear:
        return linear(x, module.weight, module.bias, scale_of(module))
    return module(x)
