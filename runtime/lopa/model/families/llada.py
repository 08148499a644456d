"""The LLaDA family: LLaDA-8B-Base/Instruct (GSAI-ML) and the D2F LoRA over LLaDA-8B-Instruct.

A LLaMA-style block under other names (`model.transformer.blocks.{i}.q_proj / attn_out / ff_proj /
up_proj / ff_out / attn_norm / ff_norm`, `model.transformer.wte`, `ln_f`, and `transformer.ff_out`
as the head), no q/k/v bias, config keys of its own (`d_model`, `n_heads`, `n_kv_heads`,
`mlp_hidden_size`, ...). Its logits are not shifted: the output at a masked position predicts that
position. `ff_proj` is the gate of the SwiGLU: silu(ff_proj(x)) * up_proj(x).

The decoding defaults are those of the authors' D2F LLaDA evaluation: blocks of 32, 512 new
tokens, add 0.1 / activate 0.95 / fill 0.9, confidence the token's probability, block-causal
attention (a block sees the prompt, the blocks before it and itself).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lopa.model.config import ModelConfig, as_int, eos_ids, optional_int, read_bool, read_float, read_int
from lopa.model.errors import CheckpointError
from lopa.model.families import LAYER, Family

_BLOCK = f"model.transformer.blocks.{LAYER}"
_LAYER = f"model.layers.{LAYER}"
MODULES = (
    ("model.embed_tokens", "model.transformer.wte"),
    (f"{_LAYER}.self_attn.q_proj", f"{_BLOCK}.q_proj"),
    (f"{_LAYER}.self_attn.k_proj", f"{_BLOCK}.k_proj"),
    (f"{_LAYER}.self_attn.v_proj", f"{_BLOCK}.v_proj"),
    (f"{_LAYER}.self_attn.o_proj", f"{_BLOCK}.attn_out"),
    (f"{_LAYER}.mlp.gate_proj", f"{_BLOCK}.ff_proj"),
    (f"{_LAYER}.mlp.up_proj", f"{_BLOCK}.up_proj"),
    (f"{_LAYER}.mlp.down_proj", f"{_BLOCK}.ff_out"),
    (f"{_LAYER}.input_layernorm", f"{_BLOCK}.attn_norm"),
    (f"{_LAYER}.post_attention_layernorm", f"{_BLOCK}.ff_norm"),
    ("model.norm", "model.transformer.ln_f"),
    ("lm_head", "model.transformer.ff_out"),
)
CONFIG_KEYS = {
    "hidden_size": "d_model",
    "intermediate_size": "mlp_hidden_size",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "max_position_embeddings": "max_sequence_length",
    "tie_word_embeddings": "weight_tying",
}
# Settings of LLaDA's configuration that select code lopa does not have, with the value lopa runs.
_REQUIRED = {
    "rope": True,
    "alibi": False,
    "block_type": "llama",
    "layer_norm_type": "rms",
    "layer_norm_with_affine": True,
    "bias_for_layer_norm": False,
    "attention_layer_norm": False,
    "include_bias": False,
    "scale_logits": False,
    "input_emb_norm": False,
    "block_group_size": 1,
}
_ACTIVATIONS = ("silu", "swiglu")


def read(raw: Mapping[str, Any], path: Path) -> ModelConfig:
    _check_supported(raw, path)
    hidden = read_int(raw, "d_model", path)
    heads = read_int(raw, "n_heads", path)
    kv_heads = heads if raw.get("n_kv_heads") is None else read_int(raw, "n_kv_heads", path)
    if raw.get("multi_query_attention"):
        kv_heads = 1
    if raw.get("mlp_hidden_size") is not None:
        intermediate = read_int(raw, "mlp_hidden_size", path)
    else:
        intermediate = as_int(raw.get("mlp_ratio", 4), "mlp_ratio", path) * hidden
    vocab = read_int(raw, "vocab_size", path)
    rows = read_int(raw, "embedding_size", path, default=vocab)  # the embedding may be padded
    if rows < vocab:
        raise CheckpointError(path, f"embedding_size ({rows}) is smaller than vocab_size ({vocab})")
    return ModelConfig(
        vocab_size=rows,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=read_int(raw, "n_layers", path),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rms_norm_eps=read_float(raw, "rms_norm_eps", 1e-5, path),
        rope_theta=read_float(raw, "rope_theta", 10000.0, path),
        max_position_embeddings=read_int(raw, "max_sequence_length", path, default=4096),
        mask_token_id=optional_int(raw, "mask_token_id", path),
        eos_token_ids=eos_ids(raw.get("eos_token_id"), path),
        pad_token_id=optional_int(raw, "pad_token_id", path),
        bos_token_id=optional_int(raw, "bos_token_id", path),
        tie_word_embeddings=read_bool(raw, "weight_tying", False, path),
        qkv_bias=read_bool(raw, "include_qkv_bias", False, path),
        family="llada",
    )


def write(config: ModelConfig) -> dict[str, Any]:
    """config.json as LLaDA's checkpoints spell it."""
    eos = config.eos_token_ids
    raw: dict[str, Any] = {
        "model_type": "llada",
        "architectures": ["LLaDAModelLM"],
        "activation_type": "silu",
        **_REQUIRED,
        "d_model": config.hidden_size,
        "n_heads": config.num_attention_heads,
        "n_kv_heads": config.num_key_value_heads,
        "n_layers": config.num_hidden_layers,
        "mlp_hidden_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
        "embedding_size": config.vocab_size,
        "max_sequence_length": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "weight_tying": config.tie_word_embeddings,
        "include_qkv_bias": config.qkv_bias,
        "mask_token_id": config.mask_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (list(eos) if eos else None),
        "pad_token_id": config.pad_token_id,
    }
    if config.bos_token_id is not None:
        raw["bos_token_id"] = config.bos_token_id
    return raw


def _check_supported(raw: Mapping[str, Any], path: Path) -> None:
    for key, runs in _REQUIRED.items():
        if key in raw and raw[key] is not None and raw[key] != runs:
            raise CheckpointError(path, f"{key}={raw[key]!r} is not supported (lopa runs {key}={runs!r})")
    activation = raw.get("activation_type", "silu")
    if activation not in _ACTIVATIONS:
        raise CheckpointError(path, f"activation_type {activation!r} is not supported (only 'silu')")
    if raw.get("rope_scaling"):
        raise CheckpointError(path, f"rope_scaling {raw['rope_scaling']!r} is not supported")


FAMILY = Family(
    name="llada",
    model_types=("llada",),
    architectures=("LLaDAModelLM",),
    logit_shift=0,
    read=read,
    write=write,
    modules=MODULES,
    config_keys=CONFIG_KEYS,
    mask_tokens=("<|mdm_mask|>",),
    end_of_turn_tokens=("<|eot_id|>",),
    d2f_lora_targets=("q_proj", "k_proj", "v_proj", "attn_out"),
    decoding_defaults={
        "block_size": 32,
        "max_new_tokens": 512,
        "tau_add": 0.1,
        "tau_act": 0.95,
        "tau_conf": 0.9,
        "conf": "prob",
        "attention": "block_causal",
    },
)
