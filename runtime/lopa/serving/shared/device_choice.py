"""model.device and workers.backend as a process runs them: `auto` resolved on this machine.

A worker resolves its own device (each may sit on another machine); `lopa serve` resolves once for
the group it starts on loopback, whose ranks then share one device (gloo on a GPU, see
config.backend_for). The start line says what was chosen and whether it was chosen for the user.
"""

from __future__ import annotations

from dataclasses import replace

from lopa.host.device import device_name, resolve_device
from lopa.serving.shared.config import (
    AUTO,
    BACKENDS_OF_DEVICE,
    ConfigError,
    ServingConfig,
    backend_for,
    backend_mismatch,
    device_kind,
)


def resolve(config: ServingConfig, ranks_per_device: int = 1) -> ServingConfig:
    """config with model.device and workers.backend resolved (auto: this machine's accelerator and
    its backend); ConfigError names the key when a set backend does not fit the device auto found."""
    device = resolve_device(config.model.device)
    backend = backend_for(config.workers.backend, device, ranks_per_device)
    kind = device_kind(device)
    if backend not in BACKENDS_OF_DEVICE[kind]:
        raise ConfigError(backend_mismatch(backend, device, kind) + _found(config.model.device, device))
    return replace(config, model=replace(config.model, device=device),
                   workers=replace(config.workers, backend=backend))


def start_line(resolved: ServingConfig, given: ServingConfig) -> str:
    """"device cuda (auto: NVIDIA H200), dtype float32, collective backend nccl (auto)"."""
    device, backend = resolved.model.device, resolved.workers.backend
    what = device_name(device)
    how = f"auto: {what or 'no CUDA or NPU device found'}" if given.model.device == AUTO else what
    chosen = " (auto)" if given.workers.backend == AUTO else ""
    return (f"device {device}{f' ({how})' if how else ''}, dtype {resolved.model.dtype}, "
            f"collective backend {backend}{chosen}")


def _found(given: str, device: str) -> str:
    return f"; model.device auto found {device} on this machine" if given == AUTO else ""
