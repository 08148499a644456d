"""FP8 weights (lopa.model.weight_formats, lopa.kernels.fp8): the format's error, what gets
quantized and when, the CPU's reference path with its batch-invariant bits, and the refusal of a
device without FP8 support."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lopa.engine import bundled_model_dir
from lopa.kernels import fp8
from lopa.kernels.fp8_products import (
    DTYPE,
    SCALED_MM,
    TABLE_ENV,
    TRITON,
    Choice,
    choose,
    keeps_dtype,
    parse_table,
    scaled_mm_linear,
)
from lopa.model import WindowedLM
from lopa.model.loader import load_model
from lopa.model.products import SCALE
from lopa.model.protocol import WindowBatch
from lopa.model.weight_formats import weights_problem
from lopa.params import AttentionMode
from lopa.synthetic.checkpoint import write_random_lora_adapter

# ||fp8 - dtype|| / ||dtype|| of the logits of the tiny random checkpoint (measured: 0.063 in fp32,
# 0.061 in bf16; its random weights give logits close to noise, the hardest case for the format).
FP8_LOGITS_TOLERANCE = 0.1


def test_quantized_weights_keep_three_mantissa_bits_per_channel() -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 96, generator=generator) * torch.logspace(-3, 2, 64).unsqueeze(1)
    weight[5] = 0.0
    values, scale = fp8.quantize(weight)
    assert values.dtype == fp8.E4M3 and scale.dtype == torch.float32 and scale.shape == (64,)
    assert scale[5] == 1.0 and (values[5].float() == 0).all()  # a row of zeros
    back = fp8.dequantize(values, scale, torch.float32)
    # 3 mantissa bits: within 1/16 of the value, or of the smallest normal (2^-6) times the scale
    bound = torch.maximum(weight.abs() / 16, scale[:, None] * 2.0**-9)
    assert ((back - weight).abs() <= bound).all()
    largest = values.float().abs().amax(dim=1)[torch.arange(64) != 5]
    assert torch.equal(largest, torch.full((63,), fp8.E4M3_MAX))  # every row uses the whole range


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_logits_are_within_the_stated_error_of_the_dtype(tiny_checkpoint: Path, dtype: str) -> None:
    plain = load_model(tiny_checkpoint, dtype=dtype)
    quantized = load_model(tiny_checkpoint, dtype=dtype, weights="fp8")
    layer = quantized.model.model.layers[0]
    assert layer.mlp.down_proj.weight.dtype == fp8.E4M3 and quantized.model.lm_head.weight.dtype == fp8.E4M3
    assert quantized.model.dtype == plain.model.dtype  # the activations keep the model dtype
    assert quantized.model.model.embed_tokens.weight.dtype == plain.model.dtype
    tokens = torch.randint(0, 120, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = plain.model(tokens, torch.arange(20)).double()
        got = quantized.model(tokens, torch.arange(20)).double()
    error = float((got - want).norm() / want.norm())
    print(f"fp8 vs {dtype} logits: relative error {error:.3f}")
    assert 0 < error < FP8_LOGITS_TOLERANCE


def test_the_adapter_is_merged_before_the_weights_are_rounded(tiny_checkpoint: Path, tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    loaded = load_model(tiny_checkpoint)
    write_random_lora_adapter(adapter, loaded.config, r=4, alpha=8.0, targets=("q_proj", "down_proj"))
    merged = load_model(tiny_checkpoint, adapter)
    quantized = load_model(tiny_checkpoint, adapter, weights="fp8")
    plain_layer, fp8_layer = merged.model.model.layers[1], quantized.model.model.layers[1]
    down = fp8_layer.mlp.down_proj
    pairs = [(plain_layer.self_attn.fused_qkv[0], fp8_layer.self_attn.fused_qkv),
             (plain_layer.mlp.down_proj.weight, (down.weight, None, down._buffers[SCALE]))]
    for want, got in pairs:
        values, scale = fp8.quantize(want)
        assert torch.equal(got[0].view(torch.uint8), values.view(torch.uint8)) and torch.equal(got[2], scale)


def test_fused_projections_share_one_quantized_weight(tiny_checkpoint: Path) -> None:
    attention = load_model(tiny_checkpoint, weights="fp8").model.model.layers[0].self_attn
    values, bias, scale = attention.fused_qkv
    assert values.dtype == fp8.E4M3 and bias is not None and scale is not None
    storage = values.untyped_storage().data_ptr()
    for linear in (attention.q_proj, attention.k_proj, attention.v_proj):
        assert linear.weight.untyped_storage().data_ptr() == storage  # views: no second copy
        assert linear._buffers[SCALE].untyped_storage().data_ptr() == scale.untyped_storage().data_ptr()


def test_a_rows_fp8_bits_do_not_depend_on_the_rows_beside_it() -> None:
    """The CPU's FP8 products go through the batch-invariant product: a ragged forward of two
    sequences gives each the bits of its lone forward."""
    model = load_model(bundled_model_dir(), weights="fp8").model
    together, alone = WindowedLM(model, 64, max_batch=2), WindowedLM(model, 64, max_batch=2)
    generator = torch.Generator().manual_seed(2)
    batches = []
    for sequence, (rows, width) in enumerate(((1, 5), (3, 11))):
        tokens = torch.randint(0, 90, (rows, width), generator=generator)
        blocks = torch.zeros(rows, width, dtype=torch.long)
        outputs = tuple(range(0, rows * width, 2))
        batches.append(WindowBatch(tokens, [width] * rows, blocks, 0, 1, AttentionMode.FULL, outputs=outputs,
                                   sequence=sequence))
    for batch, logits in zip(batches, together.forward_many(batches), strict=True):
        assert torch.equal(logits, alone.forward(batch))


def test_scaled_mm_with_row_scaled_activations_is_close_to_the_reference() -> None:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(37, 64, generator=generator).to(torch.bfloat16)
    values, scale = fp8.quantize(torch.randn(48, 64, generator=generator) / 8)
    bias = torch.randn(48, generator=generator).to(torch.bfloat16)
    got = scaled_mm_linear(x, values, scale, bias).float()
    want = fp8.linear_reference(x.float(), values, scale, bias.float())
    assert got.shape == (37, 48)
    assert float((got - want).norm() / want.norm()) < 0.05  # the activations' own 8 bits, and bf16 out


def test_the_choice_table_picks_per_shape_and_rows(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert choose(32, 4608, 3584) == TRITON and choose(512, 4608, 3584) == SCALED_MM  # the defaults
    table = (Choice(DTYPE, n=64, k=64), Choice(TRITON, 16), Choice(SCALED_MM))
    assert choose(8, 64, 64, table) == DTYPE and choose(8, 128, 64, table) == TRITON
    assert choose(17, 128, 64, table) == SCALED_MM
    path = tmp_path / "products.json"
    path.write_text('{"choices": [{"kernel": "dtype", "max_rows": 1073741824, "n": 128, "k": 64}, '
                    '{"kernel": "triton", "max_rows": 256}]}')
    monkeypatch.setenv(TABLE_ENV, str(path))
    assert keeps_dtype(128, 64) and not keeps_dtype(64, 64)
    with pytest.raises(ValueError, match=rf"{TABLE_ENV}=x: choice 0: kernel must be one of"):
        parse_table([{"kernel": "cublas"}], f"{TABLE_ENV}=x")
    with pytest.raises(ValueError, match="max_rows must be an integer >= 0"):
        parse_table([{"kernel": "triton", "max_rows": -1}], "x")


def test_weights_the_table_keeps_in_the_dtype_stay_unquantized(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = load_model(tiny_checkpoint).config
    path = tmp_path / "products.json"  # the tiny model's down product: [hidden, intermediate]
    path.write_text(f'[{{"kernel": "dtype", "n": {config.hidden_size}, "k": {config.intermediate_size}}}, '
                    '{"kernel": "triton"}]')
    monkeypatch.setenv(TABLE_ENV, str(path))
    layer = load_model(tiny_checkpoint, weights="fp8").model.model.layers[0]
    assert layer.mlp.down_proj.weight.dtype == torch.float32 and SCALE not in layer.mlp.down_proj._buffers
    assert layer.mlp.up_proj.weight.dtype == fp8.E4M3


def test_a_device_without_fp8_support_is_refused_naming_the_format(monkeypatch: pytest.MonkeyPatch) -> None:
    assert weights_problem("dtype", "cuda") is None and weights_problem("fp8", "cpu") is None
    assert weights_problem("int4", "cpu") == "must be one of dtype, fp8, got 'int4'"
    assert "fp8 weights run on CUDA or the CPU, not on npu" in (weights_problem("fp8", "npu") or "")
    # An A100 (compute capability 8.0): e4m3 products need 8.9 (Ada, Hopper).
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    problem = weights_problem("fp8", "cuda")
    assert problem == ("fp8 weights need a GPU of compute capability 8.9 or more; NVIDIA A100-SXM4-80GB "
                       "has 8.0 (use dtype)")
    with pytest.raises(ValueError, match=r"^weights: fp8 weights need a GPU of compute capability 8\.9"):
        load_model(bundled_model_dir(), device="cuda", weights="fp8")  # refused before anything is read
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert weights_problem("fp8", "cuda:0") is None
