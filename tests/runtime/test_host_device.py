"""`auto`, the default device: CUDA when present, then an NPU, else the CPU; anything else as given."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lopa.host.device import AUTO, auto_device, device_name, resolve_device


@pytest.mark.skipif(torch.cuda.is_available() or importlib.util.find_spec("torch_npu") is not None,
                    reason="this machine has an accelerator stack")
def test_auto_picks_the_cpu_on_a_machine_without_an_accelerator() -> None:
    assert auto_device() == resolve_device(AUTO) == "cpu"
    assert device_name("cpu") == ""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_picks_cuda_when_present() -> None:
    assert resolve_device(AUTO) == "cuda"
    assert device_name("cuda") == torch.cuda.get_device_name(0)


def test_a_device_given_is_kept() -> None:
    assert [resolve_device(d) for d in ("cpu", "cuda:1", "npu")] == ["cpu", "cuda:1", "npu"]
