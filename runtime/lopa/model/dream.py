"""The Dream architecture in plain torch: a Qwen2-style decoder run without a causal mask.

Parameter names match the Hugging Face Dream checkpoints (`model.layers.{i}.self_attn.q_proj.weight`,
`lm_head.weight`, ...) so their safetensors load with a strict `load_state_dict`. The model itself
knows nothing about the KV cache layout: it reads cached keys/values through `KVSource` and hands
each layer's new (post-RoPE) keys/values to an optional callback, which is how the cache stages them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from lopa.model.config import DreamConfig

# Called once per layer with that layer's window keys/values [R, L, kv_heads, head_dim] (after RoPE).
KVCallback = Callable[[int, torch.Tensor, torch.Tensor], None]


class KVSource(Protocol):
    def cached(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached keys and values of `layer`, each [C, kv_heads, head_dim], shared by every row."""


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the weight, as the reference implementation does.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [..., head_dim] for integer positions (rotate-half layout), computed in fp32."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [R, L, heads, head_dim]; cos/sin [R, L, head_dim]."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + _rotate_half(x) * sin


class DreamAttention(nn.Module):
    def __init__(self, config: DreamConfig) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        past: tuple[torch.Tensor, torch.Tensor] | None,
        on_kv: Callable[[torch.Tensor, torch.Tensor], None] | None,
    ) -> torch.Tensor:
        rows, length, _ = x.shape
        q = self.q_proj(x).view(rows, length, self.heads, self.head_dim)
        k = self.k_proj(x).view(rows, length, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(rows, length, self.kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if on_kv is not None:
            on_kv(k, v)
        if past is not None and past[0].shape[0] > 0:
            # The cached prefix is shared by every row: broadcast it in front of each row's window.
            past_k, past_v = past
            k = torch.cat((past_k.unsqueeze(0).expand(rows, -1, -1, -1), k), dim=1)
            v = torch.cat((past_v.unsqueeze(0).expand(rows, -1, -1, -1), v), dim=1)
        # On accelerators a mask + enable_gqa falls back to the math kernel (it materialises the whole
        # score matrix); repeating the KV heads keeps the memory-efficient kernel usable.
        repeat_kv = x.device.type != "cpu"
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, repeat_kv)
        return self.o_proj(out.transpose(1, 2).reshape(rows, length, self.heads * self.head_dim))


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, repeat_kv: bool
) -> torch.Tensor:
    """SDPA over [R, heads, L, D] queries and [R, kv_heads, S, D] keys/values (GQA: head h uses
    KV head h // (heads / kv_heads)), either natively or by repeating the KV heads."""
    groups = q.shape[1] // k.shape[1]
    if groups == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if not repeat_kv:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return F.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), attn_mask=mask
    )


class DreamMLP(nn.Module):
    def __init__(self, config: DreamConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DreamDecoderLayer(nn.Module):
    def __init__(self, config: DreamConfig) -> None:
        super().__init__()
        self.self_attn = DreamAttention(config)
        self.mlp = DreamMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        past: tuple[torch.Tensor, torch.Tensor] | None,
        on_kv: Callable[[torch.Tensor, torch.Tensor], None] | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, past, on_kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class DreamBaseModel(nn.Module):
    """The `model.` prefix of the checkpoint: embeddings, layers, final norm."""

    def __init__(self, config: DreamConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DreamDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DreamModel(nn.Module):
    """Dream decoder + untied lm_head. Bidirectional unless `attn_mask` restricts it."""

    def __init__(self, config: DreamConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DreamBaseModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        past: KVSource | None = None,
        on_kv: KVCallback | None = None,
    ) -> torch.Tensor:
        """Raw logits [R, L, vocab] in the model dtype.

        input_ids [R, L]; position_ids [R, L] or [L] (absolute); attn_mask bool [R, 1, L, C+L]
        (True = may attend) over the C cached keys of `past` followed by the L window keys.
        """
        rows, length = input_ids.shape
        positions = position_ids.expand(rows, length)
        x = self.model.embed_tokens(input_ids)
        cos, sin = rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for index, layer in enumerate(self.model.layers):
            layer_past = past.cached(index) if past is not None else None
            layer_kv = None if on_kv is None else _bind(on_kv, index)
            x = layer(x, cos, sin, attn_mask, layer_past, layer_kv)
        return self.lm_head(self.model.norm(x))


def _bind(on_kv: KVCallback, index: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
    return lambda k, v: on_kv(index, k, v)
