"""The layer kernels (residual + RMSNorm, rotary + K/V staging, SiLU x up) equal their references.

Tolerances: fp32 within 1e-5 relative (the same arithmetic, up to the order of an addition); bf16
within two units of the last place (conftest.bf16_close)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import HEAD_DIM, HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, ROWS, bf16_close

from lopa.kernels import rms_norm, rotary, swiglu
from lopa.model.transformer import rotary_cos_sin, signed_sin

FP32 = {"rtol": 1e-5, "atol": 1e-5}


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, **FP32)
    else:
        assert got.dtype == want.dtype
        bf16_close(got, want)


def _draw(*shape: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


CASES = [(rows, torch.float32) for rows in ROWS] + [(rows, torch.bfloat16) for rows in (1, 17, 256)]


@pytest.mark.parametrize("rows,dtype", CASES)
def test_add_rms_norm_equals_its_reference(rows: int, dtype: torch.dtype) -> None:
    x = _draw(1, rows, HIDDEN, seed=rows, dtype=dtype)
    delta = _draw(1, rows, HIDDEN, seed=rows + 1, dtype=dtype)
    weight = 1 + _draw(HIDDEN, seed=2, dtype=dtype) / 4
    total, normed = rms_norm.add_rms_norm(x, delta, weight, 1e-6)
    want_total, want_normed = rms_norm.add_rms_norm_reference(x, delta, weight, 1e-6)
    assert total.shape == x.shape and normed.shape == x.shape
    _close(total, want_total)
    _close(normed, want_normed)


CASES = [(rows, torch.float32) for rows in ROWS] + [(rows, torch.bfloat16) for rows in (1, 17, 256)]


@pytest.mark.parametrize("rows,dtype", CASES)
def test_swiglu_reads_the_fused_halves_and_equals_its_reference(rows: int, dtype: torch.dtype) -> None:
    gate_up = _draw(1, rows, 2 * INTERMEDIATE, seed=rows, dtype=dtype)
    gate, up = gate_up.chunk(2, dim=-1)  # views with the fused row stride, as the model passes them
    got = swiglu.swiglu(gate, up)
    assert got.shape == gate.shape
    _close(got, swiglu.swiglu_reference(gate, up))


def _qkv(rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qkv = _draw(1, rows, HEADS + 2 * KV_HEADS, HEAD_DIM, seed=rows, dtype=dtype)
    positions = (torch.arange(rows) * 7 % 301).view(1, rows)  # ragged, out of order
    cos, sin = rotary_cos_sin(positions, HEAD_DIM, 10000.0, dtype)
    return qkv, cos, signed_sin(sin)


CASES = [(rows, torch.float32) for rows in ROWS] + [(rows, torch.bfloat16) for rows in (1, 17, 256)]


@pytest.mark.parametrize("rows,dtype", CASES)
def test_rotary_qkv_equals_its_reference(rows: int, dtype: torch.dtype) -> None:
    qkv, cos, sin = _qkv(rows, dtype)
    got = rotary.rotary_qkv(qkv, cos, sin, HEADS, KV_HEADS)
    want = rotary.rotary_qkv_reference(qkv, cos, sin, HEADS, KV_HEADS)
    for one, other in zip(got, want, strict=True):
        assert one.shape == other.shape
        _close(one, other)
    assert torch.equal(got[2], qkv[:, :, HEADS + KV_HEADS :])  # the values: a view, untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 17, 100])
def test_rotary_qkv_stages_keys_and_values_at_their_rows(rows: int, dtype: torch.dtype) -> None:
    qkv, cos, sin = _qkv(rows, dtype)
    slots = 2 * rows + 5
    places = torch.randperm(slots, generator=torch.Generator().manual_seed(rows))[:rows]
    staged = [torch.full((slots, KV_HEADS, HEAD_DIM), 7.0, dtype=dtype) for _ in range(4)]
    rotary.rotary_qkv(qkv, cos, sin, HEADS, KV_HEADS, (staged[0], staged[1], places))
    rotary.rotary_qkv_reference(qkv, cos, sin, HEADS, KV_HEADS, (staged[2], staged[3], places))
    _close(staged[0], staged[2])
    assert torch.equal(staged[1], staged[3])  # values are copied, not computed
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[places] = False
    assert (staged[0][untouched] == 7.0).all()


def test_kernels_serve_the_7b_shapes_and_refuse_others() -> None:
    assert rms_norm.serves(3584) and not rms_norm.serves(rms_norm.MAX_HIDDEN + 1)
    assert rotary.serves(128) and not rotary.serves(96) and not rotary.serves(512)
