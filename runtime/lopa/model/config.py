"""DreamConfig: the architecture hyper-parameters read from a checkpoint's config.json."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lopa.model.errors import CheckpointError, read_json_object

CONFIG_FILE = "config.json"

_REQUIRED_INTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


@dataclass(frozen=True)
class DreamConfig:
    """Qwen2-style Dream config. Token ids are optional: they may come from the tokenizer instead."""

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

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", tuple(int(e) for e in self.eos_token_ids))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def eos_token_id(self) -> int | None:
        """The first eos id (the one used as padding when pad_token_id is absent)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def validate(self, path: str | Path = CONFIG_FILE) -> None:
        """Raise CheckpointError naming the first inconsistent field."""
        for name in (*_REQUIRED_INTS, "num_key_value_heads", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise CheckpointError(path, f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise CheckpointError(
                path,
                f"hidden_size ({self.hidden_size}) is not divisible by "
                f"num_attention_heads ({self.num_attention_heads})",
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                path,
                f"num_attention_heads ({self.num_attention_heads}) is not divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})",
            )
        if self.head_dim % 2:
            raise CheckpointError(path, f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if not self.rms_norm_eps > 0:
            raise CheckpointError(path, f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise CheckpointError(path, f"rope_theta must be > 0, got {self.rope_theta}")
        for name in ("mask_token_id", "pad_token_id", "bos_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise CheckpointError(path, f"{name} ({value}) is outside [0, vocab_size={self.vocab_size})")
        for eos in self.eos_token_ids:
            if not 0 <= eos < self.vocab_size:
                raise CheckpointError(path, f"eos_token_id ({eos}) is outside [0, {self.vocab_size})")

    @classmethod
    def from_dict(cls, raw: dict[str, Any], path: str | Path = CONFIG_FILE) -> DreamConfig:
        """Build and validate from a config.json mapping; errors name `path` and the field."""
        _check_supported(raw, path)
        try:
            ints = {name: _int(raw, name, path) for name in _REQUIRED_INTS}
            kv_heads = raw.get("num_key_value_heads", raw["num_attention_heads"])
            config = cls(
                **ints,
                num_key_value_heads=_as_int(kv_heads, "num_key_value_heads", path),
                rms_norm_eps=_float(raw, "rms_norm_eps", 1e-6, path),
                rope_theta=_float(raw, "rope_theta", 10000.0, path),
                max_position_embeddings=_as_int(
                    raw.get("max_position_embeddings", 32768), "max_position_embeddings", path
                ),
                mask_token_id=_optional_int(raw, "mask_token_id", path),
                eos_token_ids=_eos_ids(raw.get("eos_token_id"), path),
                pad_token_id=_optional_int(raw, "pad_token_id", path),
                bos_token_id=_optional_int(raw, "bos_token_id", path),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            )
        except KeyError as missing:
            raise CheckpointError(path, f"missing field {missing.args[0]!r}") from None
        config.validate(path)
        return config

    @classmethod
    def from_file(cls, path: str | Path) -> DreamConfig:
        path = Path(path)
        return cls.from_dict(read_json_object(path), path)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> DreamConfig:
        return cls.from_file(Path(model_dir) / CONFIG_FILE)

    def to_dict(self) -> dict[str, Any]:
        """config.json fields in the Hugging Face Dream spelling."""
        raw = asdict(self)
        eos = raw.pop("eos_token_ids")
        raw["eos_token_id"] = eos[0] if len(eos) == 1 else (list(eos) if eos else None)
        raw.update(model_type="Dream", architectures=["DreamModel"], hidden_act="silu")
        return raw

    def to_json(self, path: str | Path | None = None) -> str:
        """The config as JSON text; also written to `path` when given."""
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"
        if path is not None:
            Path(path).write_text(text)
        return text


def _check_supported(raw: dict[str, Any], path: str | Path) -> None:
    # Features of the Qwen2 family that this implementation does not have: refuse rather than misrun.
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(path, f"hidden_act {act!r} is not supported (only 'silu')")
    if raw.get("rope_scaling"):
        raise CheckpointError(path, f"rope_scaling {raw['rope_scaling']!r} is not supported")
    if raw.get("use_sliding_window"):
        raise CheckpointError(path, "use_sliding_window is not supported")


def _as_int(value: Any, name: str, path: str | Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(path, f"{name} must be an integer, got {value!r}")
    return value


def _int(raw: dict[str, Any], name: str, path: str | Path) -> int:
    return _as_int(raw[name], name, path)


def _optional_int(raw: dict[str, Any], name: str, path: str | Path) -> int | None:
    value = raw.get(name)
    return None if value is None else _as_int(value, name, path)


def _float(raw: dict[str, Any], name: str, default: float, path: str | Path) -> float:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckpointError(path, f"{name} must be a number, got {value!r}")
    return float(value)


def _eos_ids(value: Any, path: str | Path) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(_as_int(v, "eos_token_id", path) for v in value)
    return (_as_int(value, "eos_token_id", path),)
