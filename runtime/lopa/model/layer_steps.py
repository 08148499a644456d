"""The elementwise steps of a decoder layer, run as plain torch or fused by torch.compile.

Between its matrix products a layer runs small elementwise kernels: on an H200 a 7B round of 8
requests spent ~6 ms of its ~16 ms of kernels in them (runtime/BENCHMARKS.md). Three groups of them
fuse into one kernel each: the SwiGLU (silu, then the product with up), RoPE (a product, a roll and
an addcmul) and the residual add with the norm that follows it. A model runs them through one
`LayerSteps`: EAGER (the ops the model always ran, so a CPU's bits do not move) or, with
LOPA_TORCH_COMPILE=1 on a GPU, `compiled_steps()`: each compiled for dynamic shapes at start
(`check_compiles`), its kernels then recorded by a CUDA graph's capture like any other (a
recompilation for another layout of the inputs happens in the capture's warm-up run, before it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lopa.model.config import DreamConfig

COMPILE_ENV = "LOPA_TORCH_COMPILE"  # "1": a GPU's window model compiles its layers' steps


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, head_dim]; cos / signed_sin(sin) [B, T, head_dim] (rotate-half layout).

    x * cos + rotate_half(x) * sin, as three kernels: rotate_half(x) is x rolled by half a head
    with its first half negated, and the sign lives in sin_signed (computed once per forward).
    """
    cos, sin_signed = cos.unsqueeze(2), sin_signed.unsqueeze(2)
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x + delta (the residual stream) and its RMS norm (lopa.model.dream.RMSNorm's arithmetic)."""
    x = x + delta
    return x, F.rms_norm(x, (x.shape[-1],), weight, eps)


Tensor = torch.Tensor


@dataclass(frozen=True)
class LayerSteps:
    swiglu: Callable[[Tensor, Tensor], Tensor]
    rotary: Callable[[Tensor, Tensor, Tensor], Tensor]
    add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    compiled: bool = False


EAGER = LayerSteps(swiglu, apply_rotary, add_rms_norm)


def compiled_steps(backend: str | Callable = "inductor") -> LayerSteps:
    """The same steps through torch.compile (dynamic shapes: one compilation serves every round's
    token count; fullgraph: a step that cannot be traced whole fails here, not silently slow)."""

    def compile_step(step: Callable) -> Callable:
        return torch.compile(step, backend=backend, dynamic=True, fullgraph=True)

    return LayerSteps(compile_step(swiglu), compile_step(apply_rotary), compile_step(add_rms_norm), True)


def check_compiles(steps: LayerSteps, config: DreamConfig, dtype: torch.dtype, device: torch.device) -> None:
    """Run each step once on a few tokens laid out as a forward passes them (slices of one
    projection's output), so that a step which cannot compile here (no C compiler for Triton's
    launcher, an unsupported op) fails at start, naming LOPA_TORCH_COMPILE, rather than in the
    start-up calibration (which carries on without a budget) and then in every request."""
    tokens = 3  # >= 2 and unlike any model dimension (dynamo specializes sizes 0, 1 and equal sizes)
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    hidden, make = config.hidden_size, {"dtype": dtype, "device": device}
    try:
        gate, up = torch.randn(1, tokens, 2 * config.intermediate_size, **make).chunk(2, dim=-1)
        steps.swiglu(gate, up)
        qkv = torch.randn(1, tokens, heads + 2 * kv_heads, dim, **make)
        cos, sin = torch.randn(2, 1, tokens, dim, **make)
        steps.rotary(qkv[:, :, : heads + kv_heads], cos, sin)
        x, delta = torch.randn(2, 1, tokens, hidden, **make)
        steps.add_rms_norm(x, delta, torch.ones(hidden, **make), config.rms_norm_eps)
    except Exception as error:
        problem = f"{COMPILE_ENV}=1: the layers' steps do not compile on {device}: {error}"
        raise RuntimeError(problem) from error


def compile_wanted(device: torch.device) -> bool:
    """LOPA_TORCH_COMPILE=1 on a GPU (a CPU keeps the eager steps: its row-exact bits depend on them)."""
    return device.type == "cuda" and os.environ.get(COMPILE_ENV, "0") == "1"
