"""Batch-invariant matrix products for CPU inference.

A CPU GEMM picks its blocking from the number of rows, so one token's output bits change with how
many tokens share the product (measured: 1, 2-3 and >= 4 rows give three different results). A
batched forward would then decode a request differently beside other requests than alone.
`tiled_linear` computes every row through the same product shape: rows are padded to tiles of
TILE and multiplied tile by tile in one bmm, so a row's result depends only on its own values,
whatever the batch and wherever the row sits in it (tested bit for bit). Accelerators keep their
plain GEMM: there batch invariance is not promised (documented in the README).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

TILE = 16


def wanted(x: torch.Tensor) -> bool:
    """Inference on CPU (training keeps the plain product: its gradients need no invariance)."""
    return x.device.type == "cpu" and not torch.is_grad_enabled()


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., k] @ weight[n, k].T (+ bias), every row through one [TILE, k] x [k, n] product."""
    k, n = x.shape[-1], weight.shape[0]
    flat = x.reshape(-1, k)
    rows = flat.shape[0]
    tiles = max(1, -(-rows // TILE))
    padded = tiles * TILE
    if padded != rows:
        flat = F.pad(flat, (0, 0, 0, padded - rows))
    out = torch.bmm(flat.view(tiles, TILE, k), weight.t().expand(tiles, k, n)).view(padded, n)[:rows]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], n)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return tiled_linear(x, weight, bias) if wanted(x) else F.linear(x, weight, bias)


def apply(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module(x), batch-invariant when module is a plain nn.Linear (a PEFT-wrapped one runs as is)."""
    if type(module) is nn.Linear:
        return linear(x, module.weight, module.bias)
    return module(x)
