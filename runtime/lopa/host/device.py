"""The device a process runs its model on when asked for `auto`: CUDA, then an Ascend NPU, else the CPU.

`auto` is the default of `lopa serve`, of model.device in the config file and of the benches that
take a device, so a machine with an accelerator uses it without being told (as vLLM does). torch_npu
is imported only when no CUDA device is present and the package is installed: importing it is slow
and registers the npu device. An installed torch_npu that fails to import is an error, not a quiet
fall back to the CPU.
"""

from __future__ import annotations

import importlib.util

AUTO = "auto"


class DeviceError(RuntimeError):
    """`auto` found an accelerator stack it cannot use."""


def resolve_device(device: str) -> str:
    """`device` as the model will run: AUTO becomes cuda, npu or cpu; anything else is kept."""
    return auto_device() if device == AUTO else device


def auto_device() -> str:
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if npu_available():
        return "npu"
    return "cpu"


def npu_available() -> bool:
    """torch-npu is installed and sees an NPU (imported here only when it is installed)."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except Exception as error:  # a broken install: say so rather than serve on the CPU unnoticed
        raise DeviceError(f"device auto: torch-npu is installed but does not import ({error}); "
                          "fix it, or set the device to cpu") from None
    import torch

    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


def device_name(device: str) -> str:
    """What an accelerator is, for a start line ("NVIDIA H200"); "" for the CPU."""
    kind, _, index = device.partition(":")
    if kind == "cuda":
        import torch

        return torch.cuda.get_device_name(int(index or 0))
    if kind == "npu":
        import torch

        return torch.npu.get_device_name(int(index or 0))  # type: ignore[attr-defined]
    return ""
