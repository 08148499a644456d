"""The one YAML config file that `lopa master` and `lopa worker` read (see docs/lopa.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from lopa.host.device import AUTO
from lopa.model.decoding_defaults import model_defaults
from lopa.params import MAX_BRANCHES, DecodingParams, InvalidParameter
from lopa.performance import Switches
from lopa.scheduling.limits import Limits

DTYPES = ("float32", "bfloat16", "float16")
# How the linear weights are kept: in model.dtype, or FP8 e4m3 with per-channel scales
# (lopa.model.weight_formats.WEIGHT_FORMATS: this module stays free of torch).
WEIGHTS = ("dtype", "fp8")
# The collective backends that work with each device kind, the usual one first: gloo also broadcasts
# CUDA tensors (slower than nccl, but it lets several ranks share one GPU, which nccl refuses).
BACKENDS_OF_DEVICE = {"cpu": ("gloo",), "cuda": ("nccl", "gloo"), "npu": ("hccl",)}
BACKENDS = tuple(dict.fromkeys(b for known in BACKENDS_OF_DEVICE.values() for b in known))  # gloo, nccl, hccl
# model.device auto: the accelerator the process finds (lopa.host.device); workers.backend auto: the
# device's usual backend (loopback groups sharing one GPU: gloo). AUTO is imported from there.
MAX_PORT = 65535
MAX_BATCH = 256
DECODING_KEYS = frozenset(f.name for f in fields(DecodingParams))


class ConfigError(ValueError):
    """The config file is missing, malformed or inconsistent; the message names the key."""


def device_kind(device: str) -> str:
    """'cuda' for 'cuda:1'; ValueError (the reason) unless device is cpu, cuda[:N] or npu[:N]."""
    kind, colon, index = device.partition(":")
    if kind not in BACKENDS_OF_DEVICE or (colon and not index.isdigit()):
        raise ValueError(f"must be cpu, cuda[:N], npu[:N] or auto, got {device!r}")
    return kind


def backend_for(backend: str, device: str, ranks_per_device: int = 1) -> str:
    """workers.backend as the group runs on `device` (resolved, not auto): AUTO becomes the device's
    usual backend, gloo for several ranks on one GPU (nccl refuses them); any other value is kept."""
    if backend != AUTO:
        return backend
    kind = device_kind(device)
    return "gloo" if kind == "cuda" and ranks_per_device > 1 else BACKENDS_OF_DEVICE[kind][0]


def backend_mismatch(backend: str, device: str, kind: str) -> str:
    allowed = BACKENDS_OF_DEVICE[kind]
    hint = f"use {allowed[0]}"
    if len(allowed) > 1:
        hint += f", or {allowed[1]} for several ranks on one device"
    return f"workers.backend: {backend!r} does not match model.device {device!r} ({hint})"


def split_address(address: str) -> tuple[str, int]:
    """(host, port) of HOST:PORT; ValueError (the reason) when it is not one, or the port is out of range."""
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit():
        raise ValueError(f"must be HOST:PORT, got {address!r}")
    if not 1 <= int(port) <= MAX_PORT:
        raise ValueError(f"port must be in [1, {MAX_PORT}], got {port}")
    return host, int(port)


@dataclass(frozen=True)
class ModelConfig:
    path: str = ""  # empty = the bundled model
    adapter: str = ""
    dtype: str = "float32"
    device: str = AUTO  # cpu | cuda[:N] | npu[:N] | auto: CUDA, then an NPU, else the CPU
    weights: str = "dtype"


# The HTTP API's keys (lopa.serving.master.api.api_keys): read from the master's environment, never a
# file; several separated by commas.
API_KEY_ENV = "LOPA_API_KEY"



@dataclass(frozen=True)
class MasterConfig:
    listen: str = "0.0.0.0:50051"
    metrics_port: int = 9090  # 0 = no metrics endpoint
    health_port: int = 0  # plaintext grpc.health.v1 only (for the kubelet's probe under TLS); 0 = off
    http_port: int = 0  # the OpenAI-compatible HTTP API (TLS when tls is set); 0 = off
    model_name: str = ""  # the model id of the HTTP API; "" = the model directory's name
    model_aliases: tuple[str, ...] = ()  # more ids the HTTP API answers to (vLLM's --served-model-name)
    access_log: bool = True  # a line per HTTP request (method, path, status, bytes, seconds: no prompt)
    # The HTTP port's connections (lopa.serving.master.api.http_site): at most this many open, the
    # oldest idle one giving way to a new one; a request head due within header_timeout_s of
    # connecting, keepalive_timeout_s of idling; a body within body_timeout_s of its head.
    http_max_connections: int = 1024
    http_header_timeout_s: float = 10.0
    http_keepalive_timeout_s: float = 75.0
    http_body_timeout_s: float = 30.0
    # At the limit a body arriving slower than http_min_body_rate (bytes/s, averaged since its head)
    # gives way too; one client address holds at most http_max_connections_per_client (0 = no cap).
    http_min_body_rate: int = 16384
    http_max_connections_per_client: int = 256
    # The gRPC port (master.listen): at most grpc_max_connections open (more are refused at accept);
    # a connection must finish its HTTP/2 handshake within grpc_handshake_timeout_s, is closed after
    # grpc_idle_timeout_s without a call and asked to reconnect after grpc_max_connection_age_s
    # (its calls in flight keep up to limits.request_timeout_s to finish).
    grpc_max_connections: int = 1024
    grpc_handshake_timeout_s: float = 10.0
    grpc_idle_timeout_s: float = 75.0
    grpc_max_connection_age_s: float = 3600.0


@dataclass(frozen=True)
class WorkersConfig:
    count: int = 1
    addresses: tuple[str, ...] = ("127.0.0.1:50052",)
    listen_port: int = 50052
    metrics_port: int = 9090
    backend: str = AUTO  # gloo | nccl | hccl | auto: the device's (cpu gloo, cuda nccl, npu hccl)
    rendezvous: str = "127.0.0.1:29500"
    join_timeout_s: float = 600.0
    step_timeout_s: float = 60.0
    # The group's shared secret: every worker RPC and the rendezvous present it (see docs/guides/
    # security.md); "" = none, any client that reaches a worker port may drive it.
    secret_file: str = ""
    # Mutual TLS of the master-worker link (PEM files): a worker serves tls_cert and accepts only
    # clients whose certificate tls_ca signed; the master presents tls_cert and checks the workers'
    # against tls_ca. "" = plaintext.
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""


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
    performance: Switches = field(default_factory=Switches)  # how the workers' models run (lopa.performance)
    # The decoding keys the file set; with_model_defaults takes the others from the model. Not a key
    # of the file: dump_config writes every decoding key, so the children of `lopa serve` get them all.
    decoding_keys: frozenset[str] = field(default=DECODING_KEYS, compare=False, repr=False)

    @property
    def max_length(self) -> int:
        """KV cache length of every request (before capping by the model's position limit)."""
        return self.limits.max_length


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "decoding": DecodingParams,
    "limits": Limits,
    "master": MasterConfig,
    "workers": WorkersConfig,
    "tls": TlsConfig,
    "performance": Switches,
}


def _section(name: str, cls: type, raw: Any) -> Any:
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}: must be a mapping, got {type(raw).__name__}")
    known = [f.name for f in fields(cls)]  # in the order docs/lopa.yaml lists them
    for key in raw:
        if key not in known:
            raise ConfigError(f"{name}.{key}: unknown key (known: {', '.join(known)})")
    values = {key: _value(f"{name}.{key}", getattr(cls(), key), value) for key, value in raw.items()}
    try:
        return cls(**values)
    except InvalidParameter as error:
        raise ConfigError(f"{name}.{error}") from None
    except ValueError as error:  # a switch out of range (lopa.performance names its key)
        raise ConfigError(f"{name}.{error}") from None


def _value(key: str, default: Any, value: Any) -> Any:
    """value coerced to the type of the key's default; ConfigError naming the key when it cannot be."""
    if isinstance(default, tuple):
        if not isinstance(value, list):
            raise ConfigError(f"{key}: must be a list")
        return tuple(str(v) for v in value)
    if isinstance(default, str) and not hasattr(default, "value"):
        # A number is text here (a path or a name YAML read as one); a list, mapping or bool is not.
        if isinstance(value, (list, dict, bool)):
            raise ConfigError(f"{key}: must be a string, got {value!r}")
        return "" if value is None else str(value)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: must be true or false, got {value!r}")
        return value
    # YAML `true` is a Python int: a bool must not pass as a number.
    if isinstance(default, int) and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{key}: must be an integer, got {value!r}")
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: must be a number, got {value!r}")
        return float(value)
    return value  # enums: DecodingParams checks the choice


def parse_config(raw: Any) -> ServingConfig:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("the config file must be one YAML mapping")
    for key in raw:
        if key not in _SECTIONS:
            raise ConfigError(f"{key}: unknown section (known: {', '.join(_SECTIONS)})")
    sections = {name: _section(name, cls, raw.get(name)) for name, cls in _SECTIONS.items()}
    config = ServingConfig(**sections, decoding_keys=frozenset(raw.get("decoding") or ()))
    validate(config)
    return config


def with_model_defaults(config: ServingConfig, model_dir: str | Path) -> ServingConfig:
    """config whose decoding keys the file left out come from the model's lopa_defaults.json (else the
    paper's), as in `lopa generate`: a file without `decoding:` serves the model as it is meant to be.
    Not validated: the caller validates once it has applied its own overrides."""
    given = {name: getattr(config.decoding, name) for name in config.decoding_keys}
    decoding = model_defaults(model_dir).with_overrides(**given)
    if "max_new_tokens" not in given and decoding.max_new_tokens > config.limits.max_new_tokens:
        # The file's limit caps the model's default answer length (which the file did not choose).
        decoding = decoding.with_overrides(max_new_tokens=config.limits.max_new_tokens)
    return replace(config, decoding=decoding, decoding_keys=DECODING_KEYS)


def validate(config: ServingConfig) -> None:
    """Every cross-key and range rule of the config, in one place; ConfigError names the key."""
    _check_model(config.model, config.workers.backend)
    _check_limits(config.limits)
    _check_decoding(config.decoding, config.limits, config.decoding_keys)
    _check_master(config.master)
    _check_workers(config.workers)
    if config.tls.enabled and not (config.tls.cert and config.tls.key):
        raise ConfigError("tls: cert and key must both be set")
    if config.tls.client_ca and not config.tls.enabled:  # else it would serve plaintext, silently
        raise ConfigError("tls.client_ca: client certificates need TLS: set tls.cert and tls.key too")


def _check_model(model: ModelConfig, backend: str) -> None:
    if model.dtype not in DTYPES:
        raise ConfigError(f"model.dtype: must be one of {', '.join(DTYPES)}, got {model.dtype!r}")
    if model.weights not in WEIGHTS:
        raise ConfigError(f"model.weights: must be one of {', '.join(WEIGHTS)}, got {model.weights!r}")
    if model.device == AUTO:
        return  # resolved where the model runs (each worker); the backend is checked there
    try:
        kind = device_kind(model.device)
    except ValueError as error:
        raise ConfigError(f"model.device: {error}") from None
    # Checked here, not only in the worker: the master refuses the same file.
    if backend in BACKENDS and backend not in BACKENDS_OF_DEVICE[kind]:
        raise ConfigError(backend_mismatch(backend, model.device, kind))


def _check_limits(limits: Limits) -> None:
    for name in ("max_new_tokens", "max_prompt_tokens", "queue_size"):
        _at_least(f"limits.{name}", getattr(limits, name), 1)
    if not 1 <= limits.max_batch <= MAX_BATCH:
        raise ConfigError(f"limits.max_batch: must be in [1, {MAX_BATCH}], got {limits.max_batch}")
    if limits.max_step_tokens < 0:
        got = limits.max_step_tokens
        raise ConfigError(f"limits.max_step_tokens: must be >= 0 (0 = the device's default), got {got}")
    if not 1 <= limits.max_branches <= MAX_BRANCHES:
        raise ConfigError(f"limits.max_branches: must be in [1, {MAX_BRANCHES}], got {limits.max_branches}")
    _positive_seconds("limits.request_timeout_s", limits.request_timeout_s)
    _at_least("limits.max_model_len", limits.max_model_len, 0)


def _check_decoding(decoding: DecodingParams, limits: Limits, keys: frozenset[str]) -> None:
    """`keys`: the decoding keys the file set. The others still hold the paper's defaults until
    with_model_defaults gives them the model's (after which every key counts), so a limit is not
    checked against a default the model replaces (limits.max_new_tokens 100 vs the paper's 256)."""
    if "branches" in keys and decoding.branches > limits.max_branches:
        raise ConfigError(f"decoding.branches: {decoding.branches} exceeds limits.max_branches")
    if "max_new_tokens" in keys and decoding.max_new_tokens > limits.max_new_tokens:
        raise ConfigError(
            f"decoding.max_new_tokens: {decoding.max_new_tokens} exceeds limits.max_new_tokens "
            f"{limits.max_new_tokens}"
        )
    if "block_size" in keys and 0 < limits.max_step_tokens < decoding.block_size:
        # No round could hold two requests' base rows (a block each, at least): batching would be off.
        raise ConfigError(
            f"limits.max_step_tokens: {limits.max_step_tokens} tokens cannot hold one request's base row "
            f"(decoding.block_size {decoding.block_size}); set 0 (the device's default) or >= "
            f"{decoding.block_size}"
        )


def _check_master(master: MasterConfig) -> None:
    _address("master.listen", master.listen)
    names = [master.model_name, *master.model_aliases] if master.model_name else list(master.model_aliases)
    for index, alias in enumerate(master.model_aliases):
        if not alias.strip():
            raise ConfigError(f"master.model_aliases[{index}]: must be a non-empty name")
    if len(names) != len(set(names)):
        raise ConfigError(f"master.model_aliases: each name must differ from the others and model_name, "
                          f"got {names}")
    _at_least("master.http_max_connections", master.http_max_connections, 1)
    _at_least("master.http_min_body_rate", master.http_min_body_rate, 1)
    _at_least("master.http_max_connections_per_client", master.http_max_connections_per_client, 0)
    _at_least("master.grpc_max_connections", master.grpc_max_connections, 1)
    for key in ("http_header_timeout_s", "http_keepalive_timeout_s", "http_body_timeout_s",
                "grpc_handshake_timeout_s", "grpc_idle_timeout_s", "grpc_max_connection_age_s"):
        _positive_seconds(f"master.{key}", getattr(master, key))
    _port("master.metrics_port", master.metrics_port)  # 0 = no metrics endpoint
    _port("master.health_port", master.health_port)  # 0 = no separate health endpoint
    _port("master.http_port", master.http_port)  # 0 = no HTTP API
    listen_port = split_address(master.listen)[1]
    ports = [p for p in (listen_port, master.metrics_port, master.health_port, master.http_port) if p]
    if len(ports) != len(set(ports)):
        raise ConfigError(
            f"master: the ports of listen, metrics_port, health_port and http_port must differ, got {ports}"
        )


def _check_workers(workers: WorkersConfig) -> None:
    if workers.count < 1:
        raise ConfigError(f"workers.count: must be >= 1, got {workers.count}")
    if len(workers.addresses) != workers.count:
        raise ConfigError(
            f"workers.addresses: {len(workers.addresses)} addresses for workers.count {workers.count}"
        )
    for rank, address in enumerate(workers.addresses):
        _address(f"workers.addresses[{rank}]", address)
    if workers.backend not in (AUTO, *BACKENDS):
        known = f"{AUTO}, {', '.join(BACKENDS[:-1])} or {BACKENDS[-1]}"
        raise ConfigError(f"workers.backend: must be {known}, got {workers.backend!r}")
    _address("workers.rendezvous", workers.rendezvous)
    _port("workers.listen_port", workers.listen_port)  # 0 = the port of the worker's own address
    _port("workers.metrics_port", workers.metrics_port)  # 0 = no metrics endpoint
    _positive_seconds("workers.join_timeout_s", workers.join_timeout_s)
    _positive_seconds("workers.step_timeout_s", workers.step_timeout_s)
    tls = {"tls_cert": workers.tls_cert, "tls_key": workers.tls_key, "tls_ca": workers.tls_ca}
    missing = [key for key, value in tls.items() if not value]
    if any(tls.values()) and missing:  # mutual TLS needs all three: else one side would skip a check
        raise ConfigError(f"workers.{missing[0]}: mutual TLS of the worker link needs tls_cert, tls_key "
                          "and tls_ca together")


def _at_least(key: str, value: int, lowest: int) -> None:
    if value < lowest:
        raise ConfigError(f"{key}: must be >= {lowest}, got {value}")


def _port(key: str, value: int) -> None:
    if not 0 <= value <= MAX_PORT:
        raise ConfigError(f"{key}: must be in [0, {MAX_PORT}], got {value}")


def _address(key: str, address: str) -> None:
    try:
        split_address(address)
    except ValueError as error:
        raise ConfigError(f"{key}: {error}") from None


MAX_SECONDS = 7 * 24 * 3600.0  # a week: longer is a mistake, and torch's timeouts overflow near 25 days


def _positive_seconds(key: str, value: float) -> None:
    if not 0 < value <= MAX_SECONDS:  # also refuses NaN and infinity
        raise ConfigError(f"{key}: must be in (0, {MAX_SECONDS:.0f}] seconds, got {value:g}")


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (YAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                line = key_node.start_mark.line + 1
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r} (line {line})")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path, local: bool = False) -> ServingConfig:
    """The config file at `path`, validated. local: for `lopa serve`, which places the workers on
    loopback itself: the file's worker addresses are not needed (a count alone is enough)."""
    path = Path(path)
    try:
        with path.open() as stream:  # read from the file: YAML's errors then name it, not <unicode string>
            raw = yaml.load(stream, Loader=_UniqueKeyLoader)
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 text (byte {error.start}: {error.reason})") from None
    workers = raw.get("workers") if isinstance(raw, dict) else None
    if local and isinstance(workers, dict) and isinstance(workers.get("count"), int):
        count = workers["count"]
        workers.setdefault("addresses", [f"127.0.0.1:{50052 + rank}" for rank in range(max(count, 0))])
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
