"""Whether a worker's KV caches fit the device's free memory (checked after the model is loaded,
before the caches are allocated)."""

from __future__ import annotations

import os

import torch

from lopa.model.config import ModelConfig
from lopa.model.window import graphs_wanted, reserved_staging_tokens
from lopa.serving.shared.config import ConfigError, ServingConfig

_KV_SHARE = 0.9  # of the free memory: the rest is left for activations and the allocator


def kv_cache_bytes(
    config: ModelConfig, max_length: int, max_batch: int, element_size: int, staging_tokens: int = 0
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


def check_kv_fits(config: ServingConfig, model: ModelConfig, max_length: int, device: torch.device,
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
