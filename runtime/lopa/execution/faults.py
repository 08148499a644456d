"""Which failures leave the device usable."""

from __future__ import annotations

import torch


def is_device_fault(error: BaseException) -> bool:
    """An accelerator error (a device-side assert, an illegal access) poisons the process's device
    context: unlike an out-of-memory error or a numerical one, nothing after it can be trusted."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    return any(marker in str(error) for marker in ("CUDA error", "device-side assert", "NPU error"))
