"""Random Dream checkpoints and PEFT LoRA adapters in the exact on-disk formats the loader reads."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from lopa.model.config import DreamConfig
from lopa.model.dream import DreamModel
from lopa.synthetic.tokenizer import TOKENIZER_VOCAB_SIZE, special_token_id, write_char_tokenizer


def _with_char_tokenizer_ids(**architecture: Any) -> DreamConfig:
    """A Dream config whose special ids are those of the character tokenizer (lopa.synthetic.tokenizer)."""
    eos = special_token_id("<|endoftext|>")
    return DreamConfig(
        mask_token_id=special_token_id("<|mask|>"),
        eos_token_ids=(eos,),
        pad_token_id=eos,
        bos_token_id=eos,
        tie_word_embeddings=False,
        **architecture,
    )


def tiny_config(**overrides: Any) -> DreamConfig:
    """A Dream config small enough for CPU tests, with ids matching the character tokenizer."""
    base = _with_char_tokenizer_ids(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
    )
    return dataclasses.replace(base, **overrides)


def dream_7b_config() -> DreamConfig:
    """The architecture of Dream-v0-7B (D2F-Dream-7B's base: config.json of Dream-org/Dream-v0-Base-7B)
    with the special ids of the character tokenizer, so a random checkpoint of this shape loads, decodes
    and benchmarks like the real one."""
    return _with_char_tokenizer_ids(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=131072,
    )


PRESETS = {"dream-7b": dream_7b_config, "tiny": tiny_config}


def _random_like(
    name: str, shape: torch.Size, dtype: torch.dtype, generator: torch.Generator
) -> torch.Tensor:
    """Norm weights near 1, the rest N(0, 0.02) (the usual initialiser: activations stay finite
    through 28 layers in bf16, unlike larger weights)."""
    device = generator.device
    noise = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    return (1.0 + 0.1 * noise if "norm" in name else 0.02 * noise).to(dtype)


def random_model(
    config: DreamConfig, dtype: torch.dtype, device: str | torch.device, seed: int = 0
) -> DreamModel:
    """A DreamModel with random weights made directly on `device`, fused for inference (no files)."""
    with torch.device("meta"):
        model = DreamModel(config)
    model = model.to_empty(device=device).to(dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(_random_like(name, param.shape, dtype, generator))
    return model.eval().requires_grad_(False).fuse_projections()


def write_sharded_checkpoint(
    directory: str | Path,
    config: DreamConfig,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    shard_bytes: int = 5 * 1024**3,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> int:
    """Write a checkpoint too large to hold twice in memory: tensors drawn on `device` one at a time,
    saved in shards of about shard_bytes with model.safetensors.index.json, config.json and the
    test tokenizer. Returns the bytes written."""
    if config.vocab_size < TOKENIZER_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {TOKENIZER_VOCAB_SIZE} (the character tokenizer's size)")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config.to_json(directory / "config.json")
    generator = torch.Generator(device=device).manual_seed(seed)
    shapes = _parameter_shapes(config)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    files: list[str] = []
    weight_map: dict[str, str] = {}

    def flush() -> None:
        index = len(files) + 1
        filename = f"model-{index:05d}.safetensors"  # renamed to -of-N once N is known
        save_file(shards[-1], str(directory / filename))
        files.append(filename)
        weight_map.update(dict.fromkeys(shards[-1], filename))
        if progress is not None:
            progress(f"wrote {filename} ({total / 1e9:.1f} GB so far)")
        shards[-1] = {}

    for name, shape in shapes.items():
        tensor = _random_like(name, shape, dtype, generator).cpu()
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            flush()
            size = 0
        shards[-1][name] = tensor
        size += nbytes
        total += nbytes
    flush()
    final = {old: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, old in enumerate(files)}
    for old, new in final.items():
        (directory / old).rename(directory / new)
    renamed = {name: final[file] for name, file in weight_map.items()}
    index_json = {"metadata": {"total_size": total}, "weight_map": renamed}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")
    write_char_tokenizer(directory)
    return total


def _parameter_shapes(config: DreamConfig) -> dict[str, torch.Size]:
    with torch.device("meta"):
        model = DreamModel(config)
    shapes = {name: p.shape for name, p in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    return shapes


def random_weights(config: DreamConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 weights under the checkpoint's parameter names (norms near 1, the rest small)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in _parameter_shapes(config).items():
        noise = torch.randn(shape, generator=generator)
        weights[name] = 1.0 + 0.1 * noise if "norm" in name else 0.05 * noise
    return weights


def write_random_checkpoint(
    directory: str | Path, config: DreamConfig, shards: int = 1, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Write config.json, safetensors (+ index when shards > 1) and a tokenizer; return the weights."""
    if config.vocab_size < TOKENIZER_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {TOKENIZER_VOCAB_SIZE} (the character tokenizer's size)")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config.to_json(directory / "config.json")
    weights = random_weights(config, seed)
    names = list(weights)
    if shards == 1:
        save_file(weights, str(directory / "model.safetensors"))
    else:
        weight_map = {}
        for index in range(shards):
            part = names[index * len(names) // shards : (index + 1) * len(names) // shards]
            filename = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
            save_file({name: weights[name] for name in part}, str(directory / filename))
            weight_map.update(dict.fromkeys(part, filename))
        total = sum(t.numel() * t.element_size() for t in weights.values())
        index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")
    write_char_tokenizer(directory)
    return weights


def write_random_lora_adapter(
    directory: str | Path,
    config: DreamConfig,
    r: int = 4,
    alpha: float = 8.0,
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"),
    seed: int = 0,
    use_rslora: bool = False,
) -> dict[str, torch.Tensor]:
    """Write a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors); return its tensors.

    Unlike PEFT's initialisation, lora_B is random too, so the adapter changes the outputs.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = DreamModel(config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            prefix = f"base_model.model.{name}"
            a = torch.randn(r, module.in_features, generator=generator)
            b = torch.randn(module.out_features, r, generator=generator)
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = 0.1 * a, 0.1 * b
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": use_rslora,
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
    }
    (directory / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    return tensors
