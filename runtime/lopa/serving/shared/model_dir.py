"""The model a serving role loads: its directory (the configured path, else the bundled model), the
config file completed from it, and the KV cache length it allows."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from lopa.bundled import bundled_model_dir
from lopa.model.config import CONFIG_FILE, DreamConfig
from lopa.model.window import graphs_wanted, reserved_staging_tokens
from lopa.params import decoded_tokens
from lopa.serving.shared.config import ConfigError, ServingConfig, load_config, validate, with_model_defaults

_KV_SHARE = 0.9  # of the free memory: the rest is left for activations and the allocator


def model_path(configured: str) -> Path:
    path = Path(configured) if configured else bundled_model_dir()
    if not (path / "config.json").is_file():
        what = f"model.path {configured!r}" if configured else f"the bundled model ({path})"
        raise ConfigError(f"{what} has no config.json")
    return path


def usable_max_length(config: ServingConfig, path: Path) -> int:
    """The KV cache length of every role: the limits' prompt + answer, capped by the model's
    max_position_embeddings. ConfigError naming the key when the decoding defaults cannot fit in it
    (every request that does not set its own max_new_tokens would fail)."""
    positions = DreamConfig.from_dir(path).max_position_embeddings
    max_length = min(config.max_length, positions)
    new = config.decoding.max_new_tokens
    if decoded_tokens(new, config.decoding.block_size) + 1 > max_length:  # a prompt has a token at least
        raise ConfigError(
            f"decoding.max_new_tokens: {new} leaves no room for a prompt in the model's length {max_length} "
            f"(max_position_embeddings {positions} in {path / CONFIG_FILE}, limits.max_prompt_tokens + "
            f"limits.max_new_tokens = {config.max_length}); at most {max_length - 1}"
        )
    return max_length


def role_config(path: str) -> ServingConfig:
    """The config file of a master or worker: the decoding keys it leaves out come from the model's
    own defaults (both roles read the same file the same way), validated, and checked against the
    model's length."""
    config = load_config(path)
    directory = model_path(config.model.path)
    config = with_model_defaults(config, directory)
    try:
        validate(config)
        usable_max_length(config, directory)
    except ConfigError as error:  # the model's defaults may be what does not fit
        raise ConfigError(f"{path}: {error} (decoding keys not in the file come from the model)") from None
    return config


def kv_cache_bytes(
    config: DreamConfig, max_length: int, max_batch: int, element_size: int, staging_tokens: int = 0
) -> int:
    """Bytes of max_batch KV caches of max_length tokens (K and V of every layer), plus
    staging_tokens more of the same size (the staging reserved for CUDA graphs)."""
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * element_size
    return (max_batch * max_length + staging_tokens) * per_token


def free_bytes(device: torch.device) -> int:
    """Memory the KV caches may take: free device memory, or available RAM on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "npu":
        return int(torch.npu.mem_get_info(device)[0])  # type: ignore[attr-defined]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_kv_fits(config: ServingConfig, model: DreamConfig, max_length: int, device: torch.device,
                  element_size: int) -> int:
    """The KV caches' bytes; ConfigError naming limits.max_batch when they cannot fit (checked after
    the model is loaded, before the caches are allocated: a bad setting fails at start, not mid-run)."""
    max_batch = config.limits.max_batch
    staging = reserved_staging_tokens(max_batch, 1, max_length, graphs_wanted(device, None))
    need = kv_cache_bytes(model, max_length, max_batch, element_size, staging)
    free = free_bytes(device)
    if need > free * _KV_SHARE:
        gib = 1 << 30
        per_slot = need / max_batch / gib
        graphs = " with their CUDA-graph staging" if staging else ""
        raise ConfigError(
            f"limits.max_batch: {max_batch} KV caches of {max_length} tokens{graphs} need "
            f"{need / gib:.2f} GiB ({per_slot:.3f} GiB each) but {free / gib:.2f} GiB is free on {device}; "
            "lower limits.max_batch, or limits.max_prompt_tokens + limits.max_new_tokens"
        )
    return need
