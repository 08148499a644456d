"""The elementwise steps of a decoder layer: plain torch, fused by torch.compile, or Triton kernels.

Between its matrix products a layer runs small elementwise kernels: on an H200 a 7B round of 8
requests spent ~6 ms of its ~16 ms of kernels in them (runtime/BENCHMARKS.md). Three groups of them
fuse into one kernel each: the SwiGLU (silu, then the product with up), RoPE (a product, a roll and
an addcmul) and the residual add with the norm that follows it. A model runs them through one
`LayerSteps`:

- EAGER: the references of lopa.kernels, the ops the model always ran (a CPU's bits do not move);
- `kernel_steps()`, on a GPU with Triton unless LOPA_KERNELS=torch: the hand-written kernels of
  lopa.kernels where each serves the shape, else the references. Its rotary kernel also splits the
  q/k/v product's output (and, in a batched graph round, stages the window's K/V) in its pass.
  Checked against the references at start (`check_kernels`);
- with LOPA_TORCH_COMPILE=1 on a GPU, `compiled_steps()`: the references compiled for dynamic
  shapes at start (`check_compiles`), their kernels then recorded by a CUDA graph's capture like any
  other (a recompilation for another layout of the inputs happens in the capture's warm-up run).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lopa import performance
from lopa.kernels import dispatch, rms_norm, rotary
from lopa.kernels import swiglu as swiglu_kernel
from lopa.kernels.rms_norm import add_rms_norm_reference
from lopa.kernels.rotary import Staging, apply_rotary, rotary_qkv_reference
from lopa.kernels.swiglu import swiglu_reference
from lopa.model.config import ModelConfig

COMPILE_ENV = performance.ENV["torch_compile"]  # a GPU's window model compiles its layers' steps

# The references: what the CPU always runs (lopa.kernels keeps each beside its kernel).
swiglu = swiglu_reference
add_rms_norm = add_rms_norm_reference

Tensor = torch.Tensor
# (qkv, cos, sin_signed, heads, kv_heads, staging) -> q, k, v (lopa.kernels.rotary.rotary_qkv)
RotaryQKV = Callable[..., tuple[Tensor, Tensor, Tensor]]


@dataclass(frozen=True)
class LayerSteps:
    swiglu: Callable[[Tensor, Tensor], Tensor]
    rotary: Callable[[Tensor, Tensor, Tensor], Tensor]
    add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    compiled: bool = False
    # One pass from the q/k/v product's output to q, k, v (and the K/V staging, when given); None:
    # the attention rotates q and k together through `rotary` and stages the K/V itself.
    rotary_qkv: RotaryQKV | None = None

    @property
    def kernels(self) -> bool:
        return self.rotary_qkv is not None


EAGER = LayerSteps(swiglu, apply_rotary, add_rms_norm)


def compiled_steps(backend: str | Callable = "inductor") -> LayerSteps:
    """The same steps through torch.compile (dynamic shapes: one compilation serves every round's
    token count; fullgraph: a step that cannot be traced whole fails here, not silently slow)."""

    def compile_step(step: Callable) -> Callable:
        return torch.compile(step, backend=backend, dynamic=True, fullgraph=True)

    return LayerSteps(compile_step(swiglu), compile_step(apply_rotary), compile_step(add_rms_norm), True)


def kernel_steps() -> LayerSteps:
    """The Triton kernels of lopa.kernels where each serves the shape, else the references."""

    def fused_add_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        if rms_norm.serves(x.shape[-1]):
            return rms_norm.add_rms_norm(x, delta, weight, eps)
        return add_rms_norm_reference(x, delta, weight, eps)

    def fused_rotary_qkv(
        qkv: Tensor, cos: Tensor, sin_signed: Tensor, heads: int, kv_heads: int,
        staging: Staging | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if rotary.serves(qkv.shape[-1]):
            return rotary.rotary_qkv(qkv, cos, sin_signed, heads, kv_heads, staging)
        return rotary_qkv_reference(qkv, cos, sin_signed, heads, kv_heads, staging)

    return LayerSteps(swiglu_kernel.swiglu, apply_rotary, fused_add_rms_norm, rotary_qkv=fused_rotary_qkv)


def _sample_inputs(config: ModelConfig, dtype: torch.dtype, device: torch.device, tokens: int) -> dict:
    """A few tokens of each step's inputs, laid out as a forward passes them (slices of one
    projection's output)."""
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    hidden, make = config.hidden_size, {"dtype": dtype, "device": device}
    generator = torch.Generator(device=device).manual_seed(0)
    draw = lambda *shape: torch.randn(*shape, generator=generator, **make)  # noqa: E731
    gate, up = draw(1, tokens, 2 * config.intermediate_size).chunk(2, dim=-1)
    angles = draw(1, tokens, dim)
    return {
        "swiglu": (gate, up),
        "qkv": (draw(1, tokens, heads + 2 * kv_heads, dim), angles.cos(), angles.sin(), heads, kv_heads),
        "norm": (draw(1, tokens, hidden), draw(1, tokens, hidden), 1 + draw(hidden) / 4, config.rms_norm_eps),
    }


def check_compiles(steps: LayerSteps, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
    """Run each step once on a few tokens, so that a step which cannot compile here (no C compiler
    for Triton's launcher, an unsupported op) fails at start, naming LOPA_TORCH_COMPILE, rather than
    in the start-up calibration (which carries on without a budget) and then in every request."""
    tokens = 3  # >= 2 and unlike any model dimension (dynamo specializes sizes 0, 1 and equal sizes)
    try:
        inputs = _sample_inputs(config, dtype, device, tokens)
        steps.swiglu(*inputs["swiglu"])
        qkv, cos, sin, heads, kv_heads = inputs["qkv"]
        steps.rotary(qkv[:, :, : heads + kv_heads], cos, sin)
        steps.add_rms_norm(*inputs["norm"])
    except Exception as error:
        problem = f"{COMPILE_ENV}=1: the layers' steps do not compile on {device}: {error}"
        raise RuntimeError(problem) from error


def check_kernels(steps: LayerSteps, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
    """Run each kernel once on a few tokens against its reference: a kernel that does not compile
    on this GPU, or computes something else, fails the start with an error naming LOPA_KERNELS
    (=torch runs the references) rather than every request."""
    inputs = _sample_inputs(config, dtype, device, 5)
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype != torch.float32 else {"rtol": 1e-4, "atol": 1e-4}
    try:
        gate_up, norm = inputs["swiglu"], inputs["norm"]
        _compare("swiglu", steps.swiglu(*gate_up), swiglu(*gate_up), tolerance)
        _compare("add_rms_norm", steps.add_rms_norm(*norm), add_rms_norm(*norm), tolerance)
        if steps.rotary_qkv is not None:
            qkv = inputs["qkv"]
            _compare("rotary_qkv", steps.rotary_qkv(*qkv), rotary_qkv_reference(*qkv), tolerance)
    except Exception as error:
        env = dispatch.KERNELS_ENV
        problem = (f"{env}: a layer kernel fails its check against the reference on {device} ({error}); "
                   f"{env}=torch runs the references")
        raise RuntimeError(problem) from error


def _compare(name: str, got: Tensor | tuple, want: Tensor | tuple, tolerance: dict) -> None:
    """ValueError naming the kernel unless each output is close to its reference's."""
    outputs = got if isinstance(got, tuple) else (got,)
    references = want if isinstance(want, tuple) else (want,)
    for one, other in zip(outputs, references, strict=True):
        if one.shape != other.shape:
            raise ValueError(f"{name} gives shape {tuple(one.shape)}, its reference {tuple(other.shape)}")
        if not torch.allclose(one.float(), other.float(), **tolerance):
            worst = (one.float() - other.float()).abs().max().item()
            raise ValueError(f"{name} differs from its reference (greatest difference {worst:.3g})")


def compile_wanted(device: torch.device) -> bool:
    """torch_compile (lopa.performance) on a GPU (a CPU keeps the eager steps: its row-exact bits
    depend on them)."""
    return device.type == "cuda" and bool(performance.value("torch_compile"))


def kernels_wanted(device: torch.device) -> bool:
    """The Triton steps: on a GPU with Triton unless LOPA_KERNELS=torch (lopa.kernels.dispatch)."""
    return dispatch.uses_triton(device)
