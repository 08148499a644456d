"""PEFT LoRA adapters (D2F ships as one over a Dream or LLaDA base), merged into the weights at load
time. The adapter names its modules as its base's family does (lopa.model.families)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from lopa.model.errors import CheckpointError, read_json_object
from lopa.model.families import Family
from lopa.model.families.dream import FAMILY as DREAM
from lopa.model.weights import check_finite

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
# `<module>.lora_A.weight`, or with the adapter name left in: `<module>.lora_A.default.weight`.
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


@dataclass(frozen=True)
class LoraAdapter:
    rank: int
    scale: float  # alpha / r, or alpha / sqrt(r) with use_rslora
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module name -> (A [r, in], B [out, r])


def read_adapter(adapter_dir: str | Path, family: Family = DREAM) -> LoraAdapter:
    """Read adapter_config.json + adapter_model.safetensors of an adapter over a `family` model,
    its modules named as that family names them; the pairs are keyed by lopa's module names.
    Unsupported settings and modules the family does not have raise CheckpointError."""
    # long: the adapter's checks in the order its files are read
    adapter_dir = Path(adapter_dir)
    config_path = adapter_dir / ADAPTER_CONFIG
    raw = read_json_object(config_path)
    rank, alpha, targets = _check_config(raw, config_path)
    scale = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    weights_path = adapter_dir / ADAPTER_WEIGHTS
    if not weights_path.is_file():
        raise CheckpointError(weights_path, "file not found")
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(weights_path, f"not a readable safetensors file: {exc}") from None
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _LORA_KEY.match(key.removeprefix(_PEFT_PREFIX))
        if match is None:
            raise CheckpointError(weights_path, f"unsupported tensor {key} (only lora_A/lora_B weights are)")
        module = match["module"]
        if not _is_target(module, targets):
            raise CheckpointError(weights_path, f"{key}: {module} is not in target_modules {targets!r}")
        ours = family.lopa_name(module)
        if ours is None:
            raise CheckpointError(
                weights_path,
                f"{key}: {module} is not a module of the {family.name} model (target_modules {targets!r})",
            )
        check_finite(tensor, key, weights_path)
        halves.setdefault(ours, {})[match["which"]] = tensor
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, half in halves.items():
        for which in "AB":
            if which not in half:
                missing = f"{_PEFT_PREFIX}{family.checkpoint_name(module)}.lora_{which}.weight"
                raise CheckpointError(weights_path, f"missing tensor {missing}")
        a, b = half["A"], half["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise CheckpointError(
                weights_path,
                f"{family.checkpoint_name(module)}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} "
                f"do not have rank r={rank}",
            )
        pairs[module] = (a, b)
    if not pairs:
        raise CheckpointError(weights_path, "no LoRA weights found")
    if isinstance(targets, list):
        for target in targets:
            if not any(_is_target(family.checkpoint_name(module), [target]) for module in pairs):
                raise CheckpointError(weights_path, f"no LoRA weights for target module {target!r}")
    return LoraAdapter(rank=rank, scale=scale, pairs=pairs)


def merge_adapter(
    weights: MutableMapping[str, torch.Tensor],
    adapter: LoraAdapter,
    source: str | Path,
    family: Family = DREAM,
) -> None:
    """W += scale * B @ A for every adapted module, computed in fp32, in place of weights' entries
    (errors name the module as the `family` checkpoint does)."""
    for module, (a, b) in adapter.pairs.items():
        name, theirs = f"{module}.weight", family.checkpoint_name(module)
        if name not in weights:
            raise CheckpointError(source, f"adapter targets {theirs}, which the model does not have")
        weight = weights[name]
        if (b.shape[0], a.shape[1]) != tuple(weight.shape):
            raise CheckpointError(
                source,
                f"{theirs}: lora_B @ lora_A is {(b.shape[0], a.shape[1])}, weight is {tuple(weight.shape)}",
            )
        delta = b.to(weight.device, torch.float32) @ a.to(weight.device, torch.float32)
        weights[name] = (weight.float() + adapter.scale * delta).to(weight.dtype)


def lora_delta(adapter: LoraAdapter) -> Mapping[str, torch.Tensor]:
    """scale * B @ A per module (fp32): what merging adds; handy for checks."""
    return {module: adapter.scale * (b.float() @ a.float()) for module, (a, b) in adapter.pairs.items()}


def _check_config(raw: dict[str, Any], path: Path) -> tuple[int, float, list[str] | str]:
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise CheckpointError(path, f"peft_type {peft_type!r} is not supported (only 'LORA')")
    rank, alpha = raw.get("r"), raw.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise CheckpointError(path, f"r must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise CheckpointError(path, f"lora_alpha must be a number, got {alpha!r}")
    # Settings that change what merging means; refuse them instead of merging wrongly.
    unsupported = {
        "use_dora": bool(raw.get("use_dora")),
        "fan_in_fan_out": bool(raw.get("fan_in_fan_out")),
        "bias": raw.get("bias", "none") not in (None, "none"),
        "rank_pattern": bool(raw.get("rank_pattern")),
        "alpha_pattern": bool(raw.get("alpha_pattern")),
        "modules_to_save": bool(raw.get("modules_to_save")),
    }
    for field, bad in unsupported.items():
        if bad:
            raise CheckpointError(path, f"{field}={raw.get(field)!r} is not supported")
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        return rank, float(alpha), targets
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise CheckpointError(path, f"target_modules must be a non-empty list or a regex, got {targets!r}")
    return rank, float(alpha), targets


def _is_target(module: str, targets: list[str] | str) -> bool:
    # PEFT's rule: a regex string must match the whole module name; list entries match its suffix.
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith(f".{t}") for t in targets)
