"""The Dream family: Dream-v0-Base/Instruct-7B, DiffuCoder-7B (Qwen2 layers run without a causal
mask) and the D2F LoRAs over them.

Its names are lopa's own (`model.layers.{i}.self_attn.q_proj`, `lm_head`, ...), its logits are
shifted: the raw output at position i predicts token i + 1, as in the autoregressive model Dream
was initialised from. DecodingParams' defaults are its authors' D2F settings (docs/decoding.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lopa.model.config import (
    REQUIRED_INTS,
    ModelConfig,
    as_int,
    eos_ids,
    optional_int,
    read_float,
    read_int,
)
from lopa.model.errors import CheckpointError
from lopa.model.families import Family


def read(raw: Mapping[str, Any], path: Path) -> ModelConfig:
    _check_supported(raw, path)
    ints = {name: read_int(raw, name, path) for name in REQUIRED_INTS}
    kv_heads = raw.get("num_key_value_heads", raw.get("num_attention_heads"))
    return ModelConfig(
        **ints,
        num_key_value_heads=as_int(kv_heads, "num_key_value_heads", path),
        rms_norm_eps=read_float(raw, "rms_norm_eps", 1e-6, path),
        rope_theta=read_float(raw, "rope_theta", 10000.0, path),
        max_position_embeddings=read_int(raw, "max_position_embeddings", path, default=32768),
        mask_token_id=optional_int(raw, "mask_token_id", path),
        eos_token_ids=eos_ids(raw.get("eos_token_id"), path),
        pad_token_id=optional_int(raw, "pad_token_id", path),
        bos_token_id=optional_int(raw, "bos_token_id", path),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=True,
        family="dream",
    )


def write(config: ModelConfig) -> dict[str, Any]:
    """config.json in the Hugging Face Dream spelling."""
    raw = asdict(config)
    for lopa_only in ("qkv_bias", "family"):
        raw.pop(lopa_only)
    eos = raw.pop("eos_token_ids")
    raw["eos_token_id"] = eos[0] if len(eos) == 1 else (list(eos) if eos else None)
    raw.update(model_type="Dream", architectures=["DreamModel"], hidden_act="silu")
    return raw


def _check_supported(raw: Mapping[str, Any], path: Path) -> None:
    # Features of the Qwen2 family that this implementation does not have: refuse rather than misrun.
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(path, f"hidden_act {act!r} is not supported (only 'silu')")
    if raw.get("rope_scaling"):
        raise CheckpointError(path, f"rope_scaling {raw['rope_scaling']!r} is not supported")
    if raw.get("use_sliding_window"):
        raise CheckpointError(path, "use_sliding_window is not supported")


FAMILY = Family(
    name="dream",
    model_types=("Dream",),
    architectures=("DreamModel",),
    logit_shift=1,
    read=read,
    write=write,
    mask_tokens=("<|mask|>",),
    end_of_turn_tokens=("<|im_end|>",),
    d2f_lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"),
)
