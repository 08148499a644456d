"""The FP8 weight-only product equals the reference (x @ (e4m3 * scale).T) for every 7B product
shape scaled down, ragged row counts, with and without split-K and bias.

Tolerances: fp32 activations within 1e-5 relative to the largest output (the same products
summed in another order); bf16 within 2^-7 of it (the output is rounded to bf16, where the
interpreter rounds toward zero)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import HEAD_DIM, HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, VOCAB

from lopa.kernels import fp8, fp8_linear

# (name, n, k): the 7B's products, as the model fuses them, scaled down
SHAPES = (
    ("qkv", (HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    ("o", HIDDEN, HEADS * HEAD_DIM),
    ("gate_up", 2 * INTERMEDIATE, HIDDEN),
    ("down", HIDDEN, INTERMEDIATE),
    ("lm_head", VOCAB, HIDDEN),
)


def _case(rows: int, n: int, k: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator).to(dtype)
    weight = torch.randn(n, k, generator=generator) / k**0.5
    weight[0] *= 50  # channels of very different magnitudes: each keeps its own scale
    quantized, scale = fp8.quantize(weight)
    bias = torch.randn(n, generator=generator).to(dtype)
    return x, quantized, scale, bias


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    largest = want.abs().max().item()
    error = (got.float() - want.float()).abs().max().item()
    bound = 1e-5 if want.dtype == torch.float32 else 2**-7
    assert error <= bound * largest, (error, largest)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,n,k", SHAPES)
def test_every_product_shape_equals_the_reference(name: str, n: int, k: int, dtype: torch.dtype) -> None:
    for rows in (1, 17) if name in ("gate_up", "lm_head") else (1, 17, 256):  # the wide ones: fewer
        x, quantized, scale, bias = _case(rows, n, k, dtype, seed=rows)
        use_bias = bias if name == "qkv" else None
        exact_bias = None if use_bias is None else use_bias.float()
        want = fp8.linear_reference(x.float(), quantized, scale, exact_bias)
        got = fp8_linear.fp8_linear(x, quantized, scale, use_bias)
        assert got.dtype == dtype and got.shape == (rows, n)
        _check(got, want.to(dtype) if dtype != torch.float32 else want)


@pytest.mark.parametrize(("rows", "split_k"), [(1, 2), (100, 3)])
def test_split_k_sums_its_slices_in_order(rows: int, split_k: int) -> None:
    x, quantized, scale, bias = _case(rows, HIDDEN, INTERMEDIATE, torch.float32, seed=split_k)
    tiles = fp8_linear.Tiling(block_m=64, block_n=128, block_k=128, split_k=split_k)
    got = fp8_linear.fp8_linear(x, quantized, scale, bias, tiles)
    _check(got, fp8.linear_reference(x, quantized, scale, bias))
    assert torch.equal(got, fp8_linear.fp8_linear(x, quantized, scale, bias, tiles))  # deterministic


def test_tiling_splits_k_for_narrow_outputs_only() -> None:
    down = fp8_linear.tiling(32, 3584, 18944)  # the 7B's down product: few output tiles
    gate_up = fp8_linear.tiling(32, 37888, 3584)  # many output tiles already
    assert down.split_k > 1 and gate_up.split_k == 1
    assert fp8_linear.serves(256) and not fp8_linear.serves(257)
