"""ModelConfig: the architecture every model family is read into.

lopa.model.families reads each family's config.json into it and writes it back in the family's
spelling; one forward (lopa.model.transformer) runs every family. No torch here: the master reads
configs without it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lopa.model.errors import CheckpointError, read_json_object

CONFIG_FILE = "config.json"

REQUIRED_INTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


@dataclass(frozen=True)
class ModelConfig:
    """A pre-norm transformer with rotary positions, a SwiGLU MLP and no causal mask, its fields in
    Dream's (Qwen2's) names. `family` names the checkpoint format it was read from and is written
    back to (lopa.model.families). Token ids are optional: they may come from the tokenizer."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    mask_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = True  # q/k/v projections carry a bias (Dream's Qwen2 layers do, LLaDA's not)
    family: str = "dream"

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", tuple(int(e) for e in self.eos_token_ids))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def eos_token_id(self) -> int | None:
        """The first eos id (the one used as padding when pad_token_id is absent)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def logit_shift(self) -> int:
        """1: the raw output at position i predicts token i + 1 (Dream); 0: token i (LLaDA)."""
        from lopa.model.families import family_named

        return family_named(self.family).logit_shift

    def validate(self, path: str | Path = CONFIG_FILE, keys: Mapping[str, str] | None = None) -> None:
        """Raise CheckpointError naming the first inconsistent field, as config.json spells it
        (`keys`: lopa's field name -> the family's key)."""

        def key(name: str) -> str:
            return (keys or {}).get(name, name)

        for name in (*REQUIRED_INTS, "num_key_value_heads", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise CheckpointError(path, f"{key(name)} must be >= 1, got {getattr(self, name)}")
        heads, kv_heads = key("num_attention_heads"), key("num_key_value_heads")
        if self.hidden_size % self.num_attention_heads:
            raise CheckpointError(
                path,
                f"{key('hidden_size')} ({self.hidden_size}) is not divisible by {heads} "
                f"({self.num_attention_heads})",
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                path,
                f"{heads} ({self.num_attention_heads}) is not divisible by {kv_heads} "
                f"({self.num_key_value_heads})",
            )
        if self.head_dim % 2:
            raise CheckpointError(path, f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        for name in ("rms_norm_eps", "rope_theta"):
            if not getattr(self, name) > 0:
                raise CheckpointError(path, f"{key(name)} must be > 0, got {getattr(self, name)}")
        for name in ("mask_token_id", "pad_token_id", "bos_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise CheckpointError(
                    path, f"{key(name)} ({value}) is outside [0, {key('vocab_size')}={self.vocab_size})"
                )
        for eos in self.eos_token_ids:
            if not 0 <= eos < self.vocab_size:
                raise CheckpointError(path, f"eos_token_id ({eos}) is outside [0, {self.vocab_size})")

    @classmethod
    def from_dict(cls, raw: dict[str, Any], path: str | Path = CONFIG_FILE) -> ModelConfig:
        """Read a config.json mapping of any family lopa knows (told apart by model_type) and
        validate it; errors name `path` and the field."""
        from lopa.model.families import parse_config

        return parse_config(raw, path)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        return cls.from_dict(read_json_object(path), path)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        return cls.from_file(Path(model_dir) / CONFIG_FILE)

    def to_dict(self) -> dict[str, Any]:
        """config.json's fields in the spelling of the config's family."""
        from lopa.model.families import family_named

        return family_named(self.family).config_dict(self)

    def to_json(self, path: str | Path | None = None) -> str:
        """The config as JSON text; also written to `path` when given."""
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"
        if path is not None:
            Path(path).write_text(text)
        return text


# Readers of config.json values: each error names the file and the key.


def as_int(value: Any, name: str, path: str | Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(path, f"{name} must be an integer, got {value!r}")
    return value


def read_int(raw: Mapping[str, Any], name: str, path: str | Path, default: int | None = None) -> int:
    if name not in raw and default is None:
        raise CheckpointError(path, f"missing field {name!r}")
    return as_int(raw.get(name, default), name, path)


def optional_int(raw: Mapping[str, Any], name: str, path: str | Path) -> int | None:
    value = raw.get(name)
    return None if value is None else as_int(value, name, path)


def read_float(raw: Mapping[str, Any], name: str, default: float, path: str | Path) -> float:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckpointError(path, f"{name} must be a number, got {value!r}")
    return float(value)


def read_bool(raw: Mapping[str, Any], name: str, default: bool, path: str | Path) -> bool:
    value = raw.get(name, default)
    if not isinstance(value, bool):
        raise CheckpointError(path, f"{name} must be true or false, got {value!r}")
    return value


def eos_ids(value: Any, path: str | Path) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(as_int(v, "eos_token_id", path) for v in value)
    return (as_int(value, "eos_token_id", path),)
