"""The model of every family (plain torch: families/ says what differs between Dream and LLaDA
checkpoints, transformer the one forward), its static KV cache, and the window forward (protocol:
the WindowModel contract the executors drive).

The names below are imported on first use: the master and the clients read tokenizers and
errors from this package without importing torch (a second or more of start-up, and memory).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lopa.model.config import ModelConfig
    from lopa.model.errors import CheckpointError
    from lopa.model.kv_cache import KVCache
    from lopa.model.loader import LoadedModel, load_model, parse_dtype
    from lopa.model.lora import LoraAdapter, merge_adapter, read_adapter
    from lopa.model.mask import build_window_mask
    from lopa.model.special_ids import SpecialIds, resolve_special_ids
    from lopa.model.tokenizer import load_tokenizer
    from lopa.model.transformer import DiffusionLM
    from lopa.model.window import WindowedLM

_SOURCES = {
    "ModelConfig": "config",
    "DiffusionLM": "transformer",
    "CheckpointError": "errors",
    "KVCache": "kv_cache",
    "LoadedModel": "loader",
    "SpecialIds": "special_ids",
    "load_model": "loader",
    "parse_dtype": "loader",
    "resolve_special_ids": "special_ids",
    "LoraAdapter": "lora",
    "merge_adapter": "lora",
    "read_adapter": "lora",
    "build_window_mask": "mask",
    "load_tokenizer": "tokenizer",
    "WindowedLM": "window",
}

__all__ = [
    "CheckpointError",
    "DiffusionLM",
    "KVCache",
    "LoadedModel",
    "LoraAdapter",
    "ModelConfig",
    "SpecialIds",
    "WindowedLM",
    "build_window_mask",
    "load_model",
    "load_tokenizer",
    "merge_adapter",
    "parse_dtype",
    "read_adapter",
    "resolve_special_ids",
]


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"lopa.model.{source}"), name)
