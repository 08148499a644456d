"""The one forward of every model family in plain torch: a pre-norm transformer with rotary
positions and a SwiGLU MLP, run without a causal mask.

Parameter names are Dream's (Qwen2's): `model.layers.{i}.self_attn.q_proj.weight`, `lm_head.weight`,
...; lopa.model.families translates another family's names (LLaDA's) at load and when writing, and
says whether q/k/v carry a bias. The model itself knows nothing about the KV cache layout: it reads
cached keys/values through `KVSource` and hands each layer's new (post-RoPE) keys/values to an
optional callback, which is how the cache stages them.

For inference, `fuse_projections()` concatenates q/k/v and gate/up into one weight each (the
original parameters become views of it: no extra memory), so a layer runs 4 matrix products
instead of 7; on an accelerator every kernel launch saved counts. Every product goes through
lopa.model.products (weights in the model dtype or FP8), the elementwise steps between them through
one `LayerSteps` (lopa.model.layer_steps: the references, Triton kernels or torch.compile).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import nn

from lopa.kernels import vocab_stats
from lopa.kernels.dispatch import uses_triton
from lopa.kernels.rotary import Staging
from lopa.kernels.vocab_stats import Stats
from lopa.model import products
from lopa.model.attention import (
    KVCallback,
    KVSource,
    LayerSegment,
    LayerUniform,
    Segment,
    UniformSegments,
    attend_segments,
    attend_uniform,
    attend_with_past,
    bind,
    bind_segments,
)
from lopa.model.config import ModelConfig
from lopa.model.layer_steps import (
    EAGER,
    LayerSteps,
    check_compiles,
    check_kernels,
    compiled_steps,
    kernel_steps,
)
from lopa.params import ConfKind

# A fused projection: (weight, bias, FP8 scales), the linears' parameters views of it.
Fused = tuple[torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused kernel on accelerators, accumulating in fp32. The reference rounds to the model
        # dtype before the weight product; in bf16 this one rounds once (at most 1 ulp apart), in
        # fp32 the two are the same arithmetic. (torch.rms_norm: F.rms_norm's op without its
        # Python wrapper, which a small model's round calls 9 times.)
        return torch.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [..., head_dim] for integer positions (rotate-half layout), computed in fp32."""
    device = positions.device
    # Kept on CPU only: on an accelerator a first call may come inside a CUDA graph's capture.
    kept = device.type == "cpu"
    inv_freq = (_inv_freq if kept else frequencies)(head_dim, theta, device)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if dtype != torch.float32:
        cos, sin = cos.to(dtype), sin.to(dtype)
    return cos, sin


def frequencies(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """The rotary frequencies [head_dim / 2], fp32."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta**exponent)


_inv_freq = functools.lru_cache(maxsize=8)(frequencies)  # the same values, once per shape


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: rotate_half(x) * sin == roll(x, half) * signed_sin(sin)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def fuse_linears(linears: list[nn.Linear]) -> Fused:
    """Concatenate the weights (and biases) of linears over one input into one; each linear's
    parameters become views of the result, so the memory is not doubled."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    biases = [linear.bias for linear in linears]
    bias = torch.cat([b.detach() for b in biases]) if all(b is not None for b in biases) else None
    offset = 0
    for linear in linears:
        end = offset + linear.out_features
        linear.weight = nn.Parameter(weight[offset:end], requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias[offset:end], requires_grad=False)
        offset = end
    return weight, bias, None


def still_fused(fused: Fused | None, linears: list[nn.Module]) -> bool:
    """The fused weight still is what the (plain) linears compute: a later .to() or a replaced
    parameter breaks the sharing, and a wrapped module (a PEFT LoRA layer injected after fusing)
    computes more than its weight; then the separate projections are used."""
    if fused is None:
        return False
    storage = fused[0].untyped_storage().data_ptr()
    # Checked twice per layer and forward: a loop and the parameter dict (Module.__getattr__ and
    # generators cost more than the check itself).
    for linear in linears:
        if type(linear) is not nn.Linear:
            return False
        if linear._parameters["weight"].untyped_storage().data_ptr() != storage:
            return False
    return True


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        bias = config.qkv_bias
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.fused_qkv: Fused | None = None

    def fuse(self) -> None:
        self.fused_qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def _qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, steps: LayerSteps,
        staging: Staging | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries and keys after RoPE, values: [B, T, heads | kv_heads, head_dim] (with `staging`,
        the keys and values also written there: only the fused path with kernel steps is given one)."""
        batch, length, _ = x.shape
        modules = self._modules
        if still_fused(self.fused_qkv, [modules["q_proj"], modules["k_proj"], modules["v_proj"]]):
            assert self.fused_qkv is not None
            qkv = products.linear(x, *self.fused_qkv).view(batch, length, self.heads + 2 * self.kv_heads, -1)
            if steps.rotary_qkv is not None:
                return steps.rotary_qkv(qkv, cos, sin_signed, self.heads, self.kv_heads, staging)
            # q and k rotate together: one set of rotary kernels per layer.
            qk = steps.rotary(qkv[:, :, : self.heads + self.kv_heads], cos, sin_signed)
            return qk[:, :, : self.heads], qk[:, :, self.heads :], qkv[:, :, self.heads + self.kv_heads :]
        q = products.apply(self.q_proj, x).view(batch, length, self.heads, self.head_dim)
        k = products.apply(self.k_proj, x).view(batch, length, self.kv_heads, self.head_dim)
        v = products.apply(self.v_proj, x).view(batch, length, self.kv_heads, self.head_dim)
        return steps.rotary(q, cos, sin_signed), steps.rotary(k, cos, sin_signed), v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        mask: torch.Tensor | None,
        past: tuple[torch.Tensor, torch.Tensor] | None,
        on_kv: Callable[[torch.Tensor, torch.Tensor], None] | None,
        segments: Sequence[LayerSegment] | LayerUniform | None = None,
        steps: LayerSteps = EAGER,
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        if isinstance(segments, LayerUniform) and steps.kernels and still_fused(
            self.fused_qkv, [self.q_proj, self.k_proj, self.v_proj]
        ):
            # The rotary kernel writes the window's K/V straight into the round's staging.
            keys, values = (staged.zero_() for staged in segments.staging)
            q, k, v = self._qkv(x, cos, sin_signed, steps, (keys, values, segments.slots))
            out = attend_uniform(q, k, v, segments, staged=True)
            out = out.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim)
            return products.apply(self.o_proj, out)
        q, k, v = self._qkv(x, cos, sin_signed, steps)
        if segments is None:
            out = attend_with_past(q, k, v, mask, past, on_kv)
        elif isinstance(segments, LayerUniform):
            out = attend_uniform(q, k, v, segments)
        else:  # a ragged forward: each request's tokens see only its own cache and tokens
            out = attend_segments(q, k, v, segments)
        out = out.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim)
        return products.apply(self.o_proj, out)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.fused_gate_up: Fused | None = None

    def fuse(self) -> None:
        self.fused_gate_up = fuse_linears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor, steps: LayerSteps = EAGER) -> torch.Tensor:
        if still_fused(self.fused_gate_up, [self._modules["gate_proj"], self._modules["up_proj"]]):
            assert self.fused_gate_up is not None
            gate, up = products.linear(x, *self.fused_gate_up).chunk(2, dim=-1)
        else:
            gate, up = products.apply(self.gate_proj, x), products.apply(self.up_proj, x)
        return products.apply(self.down_proj, steps.swiglu(gate, up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        mask: torch.Tensor | None,
        past: tuple[torch.Tensor, torch.Tensor] | None,
        on_kv: Callable[[torch.Tensor, torch.Tensor], None] | None,
        segments: Sequence[LayerSegment] | LayerUniform | None = None,
        steps: LayerSteps = EAGER,
    ) -> torch.Tensor:
        normed = self.input_layernorm(x)
        attended = self.self_attn(normed, cos, sin_signed, mask, past, on_kv, segments, steps)
        norm = self.post_attention_layernorm
        x, normed = steps.add_rms_norm(x, attended, norm.weight, norm.eps)
        return x + self.mlp(normed, steps)


class BaseModel(nn.Module):
    """The `model.` prefix of the checkpoint: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if torch.get_default_device().type == "meta":
            # Built to be loaded (lopa.model.loader): Embedding's random init costs ~0.9 s of lazy
            # imports (torch._dynamo) on the meta device, for a weight the files replace.
            self.embed_tokens = nn.Embedding.from_pretrained(
                torch.empty(config.vocab_size, config.hidden_size), freeze=False
            )
        else:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DiffusionLM(nn.Module):
    """Embeddings, layers, final norm and lm_head (untied, or the embedding's weight when tied).
    Bidirectional unless `attn_mask` restricts it."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = BaseModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.steps = EAGER  # the layers' elementwise steps (lopa.model.layer_steps)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (FP8 linear weights keep it: they are upcast to it)."""
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def compile_steps(self, backend: str | Callable = "inductor") -> DiffusionLM:
        """Run the layers' elementwise steps through torch.compile (lopa.model.layer_steps); a
        RuntimeError naming LOPA_TORCH_COMPILE when they cannot compile on this device."""
        if not self.steps.compiled:
            steps = compiled_steps(backend)
            check_compiles(steps, self.config, self.dtype, self.device)
            self.steps = steps
        return self

    def use_kernels(self) -> DiffusionLM:
        """Run the layers' elementwise steps through the Triton kernels of lopa.kernels (where each
        serves the shape), each checked against its reference first: a RuntimeError naming
        LOPA_KERNELS when one fails."""
        if not self.steps.kernels:
            steps = kernel_steps()
            check_kernels(steps, self.config, self.dtype, self.device)
            self.steps = steps
        return self

    def fuse_projections(self) -> DiffusionLM:
        """Inference layout: one q/k/v and one gate/up product per layer (same parameters)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        past: KVSource | None = None,
        on_kv: KVCallback | None = None,
        output_index: torch.Tensor | None = None,
        segments: Sequence[Segment] | UniformSegments | None = None,
        head: bool = True,
    ) -> torch.Tensor:
        """Raw logits [B, T, vocab] in the model dtype, or [N, vocab] for the N flat token indices
        (into B * T) of `output_index` (the lm_head then runs on those tokens only); without `head`,
        the final norm's outputs of those tokens instead (for greedy_stats).

        input_ids [B, T]; position_ids [B, T] or [T] (absolute); attn_mask [B or 1, 1, T, C+T], bool
        (True = may attend) or additive in the model dtype, over the C cached keys of `past`
        followed by the T input keys.
        """
        hidden = self.hidden_states(input_ids, position_ids, attn_mask, past, on_kv, segments)
        if output_index is not None:
            hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, output_index)
        return self.logits(hidden) if head else hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The lm_head's product: raw logits of final-norm outputs, in the model dtype."""
        return products.apply(self.lm_head, hidden)

    def greedy_stats(self, hidden: torch.Tensor, conf: ConfKind) -> Stats:
        """The greedy statistics (token, P, Conf: lopa.execution.sampling's) of the logits of these
        final-norm outputs [N, hidden]: on a GPU with Triton (lopa.kernels.dispatch), the lm_head and
        the statistics in one pass over the vocabulary (lopa.kernels.vocab_stats), else from the
        logits."""
        weight, scale = self.lm_head.weight, products.scale_of(self.lm_head)
        if uses_triton(hidden.device) and vocab_stats.serves(weight.shape[0]):
            return vocab_stats.greedy_stats(hidden, weight, scale, conf)
        return vocab_stats.greedy_stats_reference(hidden, weight, scale, conf)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        past: KVSource | None = None,
        on_kv: KVCallback | None = None,
        segments: Sequence[Segment] | UniformSegments | None = None,
    ) -> torch.Tensor:
        """The final norm's output [B, T, hidden]: everything but the lm_head (see forward).

        With `segments` (batch 1), the tokens are several requests' folded rows: each segment
        attends under its own mask to its own cache (attn_mask, past and on_kv are then unused);
        UniformSegments: the same for requests of equal size whose caches share one tensor.
        """
        batch, length = input_ids.shape
        positions = position_ids.expand(batch, length)
        x = self.model.embed_tokens(input_ids)
        cos, sin = rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        sin_signed = signed_sin(sin)
        for index, layer in enumerate(self.model.layers):
            layer_past = past.cached(index) if past is not None else None
            layer_kv = None if on_kv is None else bind(on_kv, index)
            bound = bind_segments(segments, index)
            x = layer(x, cos, sin_signed, attn_mask, layer_past, layer_kv, bound, self.steps)
        return self.model.norm(x)
