"""The layers' elementwise steps: eager (a CPU's arithmetic, unchanged) or through torch.compile."""

from __future__ import annotations

import pytest
import torch

from lopa.model.layer_steps import COMPILE_ENV, EAGER, compile_wanted
from lopa.synthetic.checkpoint import random_model, tiny_config


def _forward(model: torch.nn.Module, tokens: int) -> torch.Tensor:
    ids = torch.arange(tokens).remainder(100).view(1, tokens)
    return model(ids, torch.arange(tokens))


def test_compiled_steps_trace_whole_for_any_token_count_and_agree() -> None:
    # The "aot_eager" backend traces and decomposes as inductor does, without generating kernels
    # (a GPU's inductor run is tests/runtime/test_cuda.py's): fullgraph fails on any graph break.
    torch._dynamo.reset()
    model = random_model(tiny_config(), torch.float32, "cpu").fuse_projections()
    with torch.no_grad():
        eager = [_forward(model, n) for n in (7, 19, 64)]
        model.compile_steps(backend="aot_eager")
        assert model.steps.compiled and model.steps is not EAGER
        compiled = [_forward(model, n) for n in (7, 19, 64)]
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def test_only_a_gpu_compiles_and_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(COMPILE_ENV, "1")
    assert compile_wanted(torch.device("cuda")) and not compile_wanted(torch.device("cpu"))
    monkeypatch.delenv(COMPILE_ENV)
    assert not compile_wanted(torch.device("cuda"))
