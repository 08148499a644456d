"""The Dream model (plain torch), its static KV cache, and the window forward (protocol: the
WindowModel contract the executors drive)."""

from lopa.model.config import DreamConfig
from lopa.model.dream import DreamModel
from lopa.model.errors import CheckpointError
from lopa.model.kv_cache import KVCache
from lopa.model.loader import LoadedModel, SpecialIds, load_model, parse_dtype, resolve_special_ids
from lopa.model.lora import LoraAdapter, merge_adapter, read_adapter
from lopa.model.mask import build_window_mask
from lopa.model.tokenizer import load_tokenizer
from lopa.model.window import DreamWindowModel

__all__ = [
    "CheckpointError",
    "DreamConfig",
    "DreamModel",
    "DreamWindowModel",
    "KVCache",
    "LoadedModel",
    "LoraAdapter",
    "SpecialIds",
    "build_window_mask",
    "load_model",
    "load_tokenizer",
    "merge_adapter",
    "parse_dtype",
    "read_adapter",
    "resolve_special_ids",
]
