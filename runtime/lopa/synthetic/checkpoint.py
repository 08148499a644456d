"""Random checkpoints and PEFT LoRA adapters of every model family, in the exact on-disk formats the
loader reads: config.json in the family's keys, safetensors under its tensor names, the adapter
under its module names (lopa.model.families)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from lopa.model.config import ModelConfig
from lopa.model.families import family_named
from lopa.model.transformer import DiffusionLM
from lopa.synthetic.tokenizer import TOKENIZER_VOCAB_SIZE, special_token_id, write_char_tokenizer


def _with_char_tokenizer_ids(**architecture: Any) -> ModelConfig:
    """A config whose special ids are those of the character tokenizer (lopa.synthetic.tokenizer)."""
    eos = special_token_id("<|endoftext|>")
    return ModelConfig(
        mask_token_id=special_token_id("<|mask|>"),
        eos_token_ids=(eos,),
        pad_token_id=eos,
        bos_token_id=eos,
        tie_word_embeddings=False,
        **architecture,
    )


def tiny_config(family: str = "dream", **overrides: Any) -> ModelConfig:
    """A config of `family` small enough for CPU tests (q/k/v biases as the family has them), with
    ids matching the character tokenizer."""
    base = _with_char_tokenizer_ids(
        family=family,
        qkv_bias=family == "dream",
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


def dream_7b_config() -> ModelConfig:
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


def llada_8b_config() -> ModelConfig:
    """The architecture of LLaDA-8B-Instruct (D2F-LLaDA-8B's base: its config.json's d_model, heads,
    layers, MLP and vocabulary) with the special ids of the character tokenizer."""
    return _with_char_tokenizer_ids(
        vocab_size=126464,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        rms_norm_eps=1e-5,
        rope_theta=500_000.0,
        max_position_embeddings=4096,
        qkv_bias=False,
        family="llada",
    )


def tiny_llada_config() -> ModelConfig:
    return tiny_config(family="llada")


PRESETS = {
    "dream-7b": dream_7b_config,
    "llada-8b": llada_8b_config,
    "tiny": tiny_config,
    "tiny-llada": tiny_llada_config,
}


def _random_like(
    name: str, shape: torch.Size, dtype: torch.dtype, generator: torch.Generator
) -> torch.Tensor:
    """Norm weights near 1, the rest N(0, 0.02) (the usual initialiser: activations stay finite
    through 28 layers in bf16, unlike larger weights)."""
    device = generator.device
    noise = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    return (1.0 + 0.1 * noise if "norm" in name else 0.02 * noise).to(dtype)


def random_model(
    config: ModelConfig, dtype: torch.dtype, device: str | torch.device, seed: int = 0
) -> DiffusionLM:
    """A DiffusionLM with random weights made directly on `device`, fused for inference (no files)."""
    with torch.device("meta"):
        model = DiffusionLM(config)
    model = model.to_empty(device=device).to(dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(_random_like(name, param.shape, dtype, generator))
    return model.eval().requires_grad_(False).fuse_projections()


def write_sharded_checkpoint(
    directory: str | Path,
    config: ModelConfig,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    shard_bytes: int = 5 * 1024**3,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> int:
    """Write a checkpoint too large to hold twice in memory: tensors drawn on `device` one at a time,
    saved in shards of about shard_bytes with model.safetensors.index.json, config.json and the
    test tokenizer. Returns the bytes written."""
    # long: the shards and their index, written in order
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

    for name, (theirs, shape) in shapes.items():
        tensor = _random_like(name, shape, dtype, generator).cpu()
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            flush()
            size = 0
        shards[-1][theirs] = tensor
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


def _parameter_shapes(config: ModelConfig) -> dict[str, tuple[str, torch.Size]]:
    """lopa's name of each tensor a checkpoint holds -> (its name in the family's files, its shape)."""
    with torch.device("meta"):
        model = DiffusionLM(config)
    shapes = {name: p.shape for name, p in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    family = family_named(config.family)
    return {name: (family.checkpoint_name(name), shape) for name, shape in shapes.items()}


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 weights under the checkpoint's tensor names (norms near 1, the rest small)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, (theirs, shape) in _parameter_shapes(config).items():
        noise = torch.randn(shape, generator=generator)
        weights[theirs] = 1.0 + 0.1 * noise if "norm" in name else 0.05 * noise
    return weights


def write_random_checkpoint(
    directory: str | Path, config: ModelConfig, shards: int = 1, seed: int = 0
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
    config: ModelConfig,
    r: int = 4,
    alpha: float = 8.0,
    targets: tuple[str, ...] | None = None,
    seed: int = 0,
    use_rslora: bool = False,
) -> dict[str, torch.Tensor]:
    """Write a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) over a `config`
    model, its modules named as the family names them; return its tensors. `targets` default to
    the family's D2F LoRA (q, k, v and the attention output).

    Unlike PEFT's initialisation, lora_B is random too, so the adapter changes the outputs.
    """
    # long: the adapter's config and tensors, as PEFT writes them
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    family = family_named(config.family)
    targets = family.d2f_lora_targets if targets is None else targets
    with torch.device("meta"):
        model = DiffusionLM(config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        theirs = family.checkpoint_name(name)
        if theirs.rsplit(".", 1)[-1] in targets:
            prefix = f"base_model.model.{theirs}"
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
