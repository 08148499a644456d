"""The one YAML config file that `lopa master` and `lopa worker` read (see docs/lopa.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from lopa.params import DecodingParams, InvalidParameter


class ConfigError(ValueError):
    """The config file is missing, malformed or inconsistent; the message names the key."""


@dataclass(frozen=True)
class ModelConfig:
    path: str = ""  # empty = the bundled model
    adapter: str = ""
    dtype: str = "float32"
    device: str = "cpu"


@dataclass(frozen=True)
class Limits:
    max_branches: int = 15
    max_new_tokens: int = 1024
    max_prompt_tokens: int = 2048
    queue_size: int = 64
    request_timeout_s: float = 300.0


@dataclass(frozen=True)
class MasterConfig:
    listen: str = "0.0.0.0:50051"
    metrics_port: int = 9090  # 0 = no metrics endpoint


@dataclass(frozen=True)
class WorkersConfig:
    count: int = 1
    addresses: tuple[str, ...] = ("127.0.0.1:50052",)
    listen_port: int = 50052
    metrics_port: int = 9090
    backend: str = "gloo"
    rendezvous: str = "127.0.0.1:29500"
    join_timeout_s: float = 600.0
    step_timeout_s: float = 60.0


@dataclass(frozen=True)
class TlsConfig:
    cert: str = ""
    key: str = ""
    client_ca: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.key)


@dataclass(frozen=True)
class ServingConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    decoding: DecodingParams = field(default_factory=DecodingParams)
    limits: Limits = field(default_factory=Limits)
    master: MasterConfig = field(default_factory=MasterConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)

    @property
    def max_length(self) -> int:
        """KV cache length of every request (before capping by the model's position limit)."""
        return self.limits.max_prompt_tokens + self.limits.max_new_tokens


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "decoding": DecodingParams,
    "limits": Limits,
    "master": MasterConfig,
    "workers": WorkersConfig,
    "tls": TlsConfig,
}


def _section(name: str, cls: type, raw: Any) -> Any:
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}: must be a mapping, got {type(raw).__name__}")
    known = {f.name: f for f in fields(cls)}
    values = {}
    for key, value in raw.items():
        if key not in known:
            raise ConfigError(f"{name}.{key}: unknown key (known: {', '.join(known)})")
        default = getattr(cls(), key)
        if isinstance(default, tuple):
            if not isinstance(value, list):
                raise ConfigError(f"{name}.{key}: must be a list")
            value = tuple(str(v) for v in value)
        elif isinstance(default, bool) or (isinstance(default, str) and not hasattr(default, "value")):
            value = "" if value is None else str(value)
        elif isinstance(default, (int, float)) and not isinstance(value, (int, float)):
            raise ConfigError(f"{name}.{key}: must be a number, got {value!r}")
        elif isinstance(default, float):
            value = float(value)
        values[key] = value
    try:
        return cls(**values)
    except InvalidParameter as error:
        raise ConfigError(f"{name}.{error}") from None


def parse_config(raw: Any) -> ServingConfig:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("the config file must be one YAML mapping")
    for key in raw:
        if key not in _SECTIONS:
            raise ConfigError(f"{key}: unknown section (known: {', '.join(_SECTIONS)})")
    config = ServingConfig(**{name: _section(name, cls, raw.get(name)) for name, cls in _SECTIONS.items()})
    validate(config)
    return config


def validate(config: ServingConfig) -> None:
    workers, limits = config.workers, config.limits
    if workers.count < 1:
        raise ConfigError(f"workers.count: must be >= 1, got {workers.count}")
    if len(workers.addresses) != workers.count:
        raise ConfigError(
            f"workers.addresses: {len(workers.addresses)} addresses for workers.count {workers.count}"
        )
    if workers.backend not in ("gloo", "nccl", "hccl"):
        raise ConfigError(f"workers.backend: must be gloo, nccl or hccl, got {workers.backend!r}")
    for name in ("max_branches", "max_new_tokens", "max_prompt_tokens", "queue_size"):
        if getattr(limits, name) < 1:
            raise ConfigError(f"limits.{name}: must be >= 1")
    if config.decoding.branches > limits.max_branches:
        raise ConfigError(f"decoding.branches: {config.decoding.branches} exceeds limits.max_branches")
    if config.decoding.max_new_tokens > limits.max_new_tokens:
        raise ConfigError(f"decoding.max_new_tokens: exceeds limits.max_new_tokens {limits.max_new_tokens}")
    if config.tls.enabled and not (config.tls.cert and config.tls.key):
        raise ConfigError("tls: cert and key must both be set")


def load_config(path: str | Path) -> ServingConfig:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    try:
        return parse_config(raw)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None


def dump_config(config: ServingConfig) -> str:
    """YAML of a config (what `lopa serve` writes for its subprocesses)."""

    def plain(value: Any) -> Any:
        value = getattr(value, "value", value)
        return list(value) if isinstance(value, tuple) else value

    document = {
        name: {f.name: plain(getattr(getattr(config, name), f.name)) for f in fields(cls)}
        for name, cls in _SECTIONS.items()
    }
    return yaml.safe_dump(document, sort_keys=False)
