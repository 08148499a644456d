"""The performance switches (lopa.performance): config keys a worker installs, each overridden by its
environment variable, read in one module by the model and the kernels."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lopa import performance
from lopa.kernels import dispatch, fp8_products
from lopa.model.layer_steps import compile_wanted
from lopa.model.window import graph_capture_tokens, graphs_wanted
from lopa.performance import Switches

CUDA = torch.device("cuda")  # a device's kind is all these decisions read: no GPU needed


@pytest.fixture(autouse=True)
def defaults(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for variable in performance.ENV.values():
        monkeypatch.delenv(variable, raising=False)
    yield
    performance.install(Switches())


def test_the_installed_switches_decide_and_each_variable_overrides_its_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert graphs_wanted(CUDA, None) and graph_capture_tokens() is None and not compile_wanted(CUDA)
    assert dispatch.mode() == "triton" and fp8_products.table() == fp8_products.DEFAULT_TABLE
    table = tmp_path / "table.json"
    table.write_text(json.dumps([{"kernel": "dequant"}]))
    performance.install(Switches(cuda_graphs="eager", cuda_graph_tokens=512, kernels="torch",
                                 torch_compile=True, fp8_products=str(table)))
    assert not graphs_wanted(CUDA, None) and graph_capture_tokens() == 512 and compile_wanted(CUDA)
    assert dispatch.mode() == "torch" and [c.kernel for c in fp8_products.table()] == ["dequant"]
    assert not compile_wanted(torch.device("cpu"))  # a CPU keeps its row-exact eager steps
    monkeypatch.setenv("LOPA_CUDA_GRAPHS", "1")
    monkeypatch.setenv("LOPA_KERNELS", "triton")
    assert graphs_wanted(CUDA, None) and dispatch.mode() == "triton"
    assert graph_capture_tokens() == 512  # the others keep the installed values
    assert performance.current() == Switches(cuda_graphs="captured", cuda_graph_tokens=512, kernels="triton",
                                             torch_compile=True, fp8_products=str(table))


@pytest.mark.parametrize(
    ("variable", "text", "says"),
    [
        ("LOPA_CUDA_GRAPHS", "sometimes", "must be 1, 0 or one of captured, eager, uncaptured"),
        ("LOPA_CUDA_GRAPH_TOKENS", "-5", "must be an integer >= 0"),
        ("LOPA_KERNELS", "cuda", "must be one of triton, torch, interpret"),
        ("LOPA_TORCH_COMPILE", "yes", "must be 1 or 0"),
    ],
)
def test_a_variable_that_does_not_parse_is_named(
    monkeypatch: pytest.MonkeyPatch, variable: str, text: str, says: str
) -> None:
    monkeypatch.setenv(variable, text)
    with pytest.raises(ValueError, match=f"^{variable}: {re.escape(says)}"):
        performance.current()


def test_out_of_range_switches_are_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"^cuda_graph_tokens: must be >= 0"):
        Switches(cuda_graph_tokens=-2)
