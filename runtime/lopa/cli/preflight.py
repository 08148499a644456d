"""Checks of what a command is about to use (a device, a listen address) before anything starts.

torch and gRPC report these deep inside start-up, as tracebacks; here each becomes a reason that the
caller puts after the flag or config key it came from.
"""

from __future__ import annotations

import importlib.util
import socket

from lopa.host.device import AUTO, DeviceError, resolve_device
from lopa.serving.shared.config import device_kind, split_address


def device_problem(device: str) -> str | None:
    """Why `device` cannot be used on this machine (None when it can): unknown, no GPU, no torch-npu;
    auto: a broken accelerator stack (lopa.host.device)."""
    if device == AUTO:
        try:
            device = resolve_device(device)
        except DeviceError as error:
            return str(error)
    try:
        kind = device_kind(device)
    except ValueError as error:
        return str(error)
    index = int(device.partition(":")[2] or 0)
    if kind == "cuda":
        import torch

        return _index_problem(device, index, torch.cuda.device_count(), "CUDA")
    if kind == "npu":
        if importlib.util.find_spec("torch_npu") is None:
            return f"{device!r} needs the torch-npu package (Ascend), which is not installed"
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)

        return _index_problem(device, index, torch.npu.device_count(), "NPU")  # type: ignore[attr-defined]
    return None


def weights_problem(weights: str, device: str) -> str | None:
    """Why the weights format cannot run on `device` (None when it can): FP8 on a GPU without FP8
    support (lopa.model.weight_formats)."""
    if weights == "dtype":
        return None  # no torch import for the default
    from lopa.model.weight_formats import weights_problem as problem

    return problem(weights, device)


def _index_problem(device: str, index: int, count: int, what: str) -> str | None:
    if count == 0:
        return f"{device!r}: no {what} device is available on this machine"
    if index >= count:
        return f"{device!r}: this machine has {count} {what} device(s) (indices 0-{count - 1})"
    return None


def listen_problem(address: str) -> str | None:
    """Why `address` cannot be listened on now (None when it can): not HOST:PORT, a busy port, a host
    that is not this machine's. A probe bind, released at once."""
    try:
        host, port = split_address(address)
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free
            probe.bind(sockaddr)
    except ValueError as error:
        return str(error)
    except OSError as error:
        return f"cannot listen on {address}: {error.strerror or error}"
    return None
