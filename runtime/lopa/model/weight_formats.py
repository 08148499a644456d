"""How a loaded model keeps its linear weights: in the model dtype, or FP8.

`dtype` (the default) keeps every weight in the model dtype. `fp8` quantizes every linear weight of
the decoder layers and the lm_head to e4m3 with one scale per output channel (lopa.kernels.fp8),
after the checkpoint is loaded, a LoRA adapter merged and the projections fused; the embedding and
the norms keep the model dtype, and so do the activations: each product upcasts its weight (a GPU in
registers, lopa.kernels.fp8_products; the CPU through the reference). The weights take about half
their bf16 bytes.

FP8 needs a GPU with FP8 support (compute capability 8.9 or more: Ada, Hopper and later), or the
CPU, where the reference path computes it (for accuracy checks: it is slower than the dtype).
"""

from __future__ import annotations

import torch
from torch import nn

from lopa.host.device import resolve_device
from lopa.kernels import fp8
from lopa.kernels.fp8_products import keeps_dtype
from lopa.model.products import SCALE

DTYPE, FP8 = "dtype", "fp8"
WEIGHT_FORMATS = (DTYPE, FP8)
FP8_CAPABILITY = (8, 9)


def weights_problem(weights: str, device: str | torch.device) -> str | None:
    """Why `weights` cannot be used on `device` (None when it can): an unknown format, or FP8 on a
    device without FP8 support."""
    if weights not in WEIGHT_FORMATS:
        return f"must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}"
    device = resolve_device(str(device))  # auto: the device this machine would run on
    kind = device.partition(":")[0]  # not torch.device: "npu" needs torch-npu to parse
    if weights == DTYPE or kind == "cpu":
        return None
    if kind != "cuda":
        return f"fp8 weights run on CUDA or the CPU, not on {kind}"
    device = torch.device(device)
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (f"fp8 weights need a GPU of compute capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or "
                f"more; {name} has {capability[0]}.{capability[1]} (use dtype)")
    return None


def quantize_fp8(model: nn.Module) -> int:
    """Quantize the model's linear weights in place (see the module docstring); returns how many
    weight tensors were quantized. Weights whose shape lopa.kernels.fp8_products keeps in the model
    dtype (a `bf16` choice) are left as they are."""
    quantized = 0
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        for fused_name, linears in (("fused_qkv", [attention.q_proj, attention.k_proj, attention.v_proj]),
                                    ("fused_gate_up", [mlp.gate_proj, mlp.up_proj])):
            owner = attention if fused_name == "fused_qkv" else mlp
            fused = getattr(owner, fused_name)
            if fused is not None and fused[2] is None and not keeps_dtype(*fused[0].shape):
                setattr(owner, fused_name, _quantize_fused(fused, linears))
                quantized += 1
        for linear in (attention.o_proj, mlp.down_proj):
            quantized += _quantize_linear(linear)
    return quantized + _quantize_linear(model.lm_head)


def _quantize_linear(linear: nn.Linear) -> int:
    if SCALE in linear._buffers or keeps_dtype(*linear.weight.shape):
        return 0
    values, scale = fp8.quantize(linear.weight.detach())
    linear.weight = nn.Parameter(values, requires_grad=False)
    linear.register_buffer(SCALE, scale)
    return 1


def _quantize_fused(
    fused: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None], linears: list[nn.Linear]
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The fused weight quantized, each linear's weight and scales views of it (a per-channel scale
    is per row: the fused weight's rows are the linears' rows)."""
    weight, bias, _ = fused
    values, scale = fp8.quantize(weight)
    offset = 0
    for linear in linears:
        end = offset + linear.out_features
        linear.weight = nn.Parameter(values[offset:end], requires_grad=False)
        linear.register_buffer(SCALE, scale[offset:end])
        offset = end
    return values, bias, scale
