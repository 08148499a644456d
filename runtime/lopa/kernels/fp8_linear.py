"""The FP8 weight-only product for skinny inputs: x [M, K] (bf16) @ (e4m3 [N, K] x scales [N]).T.

Where the model uses it: every linear product of an FP8 model on a GPU with at most MAX_ROWS rows
(lopa.kernels.fp8_products picks it per shape). A verification forward has 32-256 tokens: its
products read every weight byte for little arithmetic, so their time is the weights' bytes over
the memory bandwidth, and e4m3 halves the bytes. cuBLASLt's FP8 product (torch._scaled_mm) also
quantizes the activations and is tuned for large M: at these shapes it is slower than bf16 for the
narrow outputs (measured on an H200, design/landscape.md). This kernel reads the e4m3 weights,
upcasts them in registers to the activations' dtype, multiplies on the tensor cores and applies
the per-channel scale once per output after the accumulation.

Narrow outputs (o and down: N = hidden) give few output tiles, too few programs to keep every SM
reading: the reduction over K is then split (split-K) into SPLIT_K slices whose fp32 partial sums
a second kernel adds in a fixed order (deterministic, unlike atomics), applying scale and bias.

Serves: M <= MAX_ROWS, any N and K; activations in bf16, fp16 or fp32; an optional bias. In the
interpreter (TRITON_INTERPRET=1, no bf16 matrix product in numpy) the tiles are multiplied in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lopa.kernels.triton_support import cdiv, interpreting, kernel, next_power_of_two, tl

MAX_ROWS = 256
MAX_SPLIT_K = 16


@dataclass(frozen=True)
class Tiling:
    block_m: int
    block_n: int
    block_k: int
    split_k: int


def tiling(rows: int, n: int, k: int, programs: int = 264) -> Tiling:
    """Tiles for a product of `rows` x k by k x n: the rows in one or few tiles, and K split until
    about `programs` programs run (twice the SMs of an H100 / H200)."""
    block_m = min(64, max(16, next_power_of_two(rows)))
    block_n = 64 if n <= 8192 else 128
    block_k = 128
    tiles = cdiv(rows, block_m) * cdiv(n, block_n)
    split = 1
    while split < MAX_SPLIT_K and tiles * split * 2 <= programs and k // (split * 2) >= 2 * block_k:
        split *= 2
    return Tiling(block_m, block_n, block_k, split)


def serves(rows: int) -> bool:
    return rows <= MAX_ROWS


@kernel
def _fp8_product(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, partial_ptr,
    m, n, k, x_stride, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    depth = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    begin = split * k_per_split
    for offset in range(0, k_per_split, BLOCK_K):
        ks = begin + offset + depth
        inside_k = ks < k
        x = tl.load(x_ptr + rows[:, None] * x_stride + ks[None, :],
                    mask=(rows[:, None] < m) & inside_k[None, :], other=0.0)
        w = tl.load(w_ptr + cols[None, :] * k + ks[:, None],
                    mask=(cols[None, :] < n) & inside_k[:, None], other=0.0)
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    inside = (rows[:, None] < m) & (cols[None, :] < n)
    if SPLIT == 1:
        scale = tl.load(scale_ptr + cols, mask=cols < n, other=0.0)
        result = acc * scale[None, :]
        if HAS_BIAS:
            result += tl.load(bias_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rows[:, None] * n + cols[None, :]
        tl.store(out, result.to(out_ptr.dtype.element_ty), mask=inside)
    else:
        tl.store(partial_ptr + split * m * n + rows[:, None] * n + cols[None, :], acc, mask=inside)


@kernel
def _sum_splits(
    partial_ptr, scale_ptr, bias_ptr, out_ptr, m, n,
    SPLIT: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    place = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = place < m * n
    cols = place % n
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in range(SPLIT):  # in order: the same sum every time
        total += tl.load(partial_ptr + split * m * n + place, mask=inside, other=0.0)
    total = total * tl.load(scale_ptr + cols, mask=inside, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + place, total.to(out_ptr.dtype.element_ty), mask=inside)


def fp8_linear(
    x: torch.Tensor, quantized: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
    tiles: Tiling | None = None,
) -> torch.Tensor:
    """x [..., K] @ (quantized [N, K] * scale[:, None]).T (+ bias) in x's dtype (see the module
    docstring); `tiles` overrides the tiling (tests use it to run split-K on small shapes)."""
    k, n = x.shape[-1], quantized.shape[0]
    flat = x.reshape(-1, k)
    if flat.stride(1) != 1:
        flat = flat.contiguous()
    m = flat.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    tiles = tiles or tiling(m, n, k)
    k_per_split = cdiv(cdiv(k, tiles.split_k), tiles.block_k) * tiles.block_k
    partial = out
    if tiles.split_k > 1:
        partial = torch.empty((tiles.split_k, m, n), dtype=torch.float32, device=x.device)
    bias_arg = bias if bias is not None else scale
    dot_fp32 = interpreting() or x.dtype == torch.float32
    grid = (cdiv(m, tiles.block_m), cdiv(n, tiles.block_n), tiles.split_k)
    _fp8_product[grid](
        flat, quantized, scale, bias_arg, out, partial, m, n, k, flat.stride(0), k_per_split,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, SPLIT=tiles.split_k,
        HAS_BIAS=bias is not None, DOT_FP32=dot_fp32,
    )
    if tiles.split_k > 1:
        block = 1024
        _sum_splits[(cdiv(m * n, block),)](
            partial, scale, bias_arg, out, m, n, SPLIT=tiles.split_k, BLOCK=block, HAS_BIAS=bias is not None,
        )
    return out.view(*x.shape[:-1], n)
