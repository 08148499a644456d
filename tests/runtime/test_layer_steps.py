"""The layers' elementwise steps: eager (a CPU's arithmetic, unchanged) or through torch.compile."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from lopa.model.layer_steps import COMPILE_ENV, EAGER, compile_wanted
from lopa.synthetic.checkpoint import random_model, tiny_config


def _forward(model: torch.nn.Module, tokens: int) -> torch.Tensor:
    ids = torch.arange(tokens).remainder(100).view(1, tokens)
    return model(ids, torch.arange(tokens))


def _counting(compiles: list[int], calls: list[int]) -> Callable:
    """A torch.compile backend that counts the graphs it compiles and the calls of each, running
    them as aot_eager (traced and decomposed as inductor would, without generating kernels)."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable:
        compiles.append(1)
        run = aot_eager(graph, example_inputs)

        def counted(*args: torch.Tensor) -> object:
            calls.append(1)
            return run(*args)

        return counted

    return backend


def test_compiled_steps_run_in_the_forward_for_any_token_count_and_agree() -> None:
    # fullgraph fails on any graph break; a GPU's inductor run is tests/runtime/test_cuda.py's.
    torch._dynamo.reset()
    try:
        config = tiny_config()
        model = random_model(config, torch.float32, "cpu").fuse_projections()
        compiles: list[int] = []
        calls: list[int] = []
        counts = (7, 19, 41)
        with torch.no_grad():
            eager = [_forward(model, n) for n in counts]
            model.compile_steps(backend=_counting(compiles, calls))
            assert model.steps.compiled and model.steps is not EAGER
            assert len(compiles) >= 3 and len(calls) == 3  # each step compiled and run on a few tokens
            got = [_forward(model, n) for n in counts]
        # Every layer of every forward ran the three compiled steps, for any token count, without
        # compiling them over and over.
        assert len(calls) == 3 + 3 * config.num_hidden_layers * len(counts)
        assert len(compiles) <= 8
        for one, want in zip(got, eager, strict=True):
            torch.testing.assert_close(one, want, rtol=1e-5, atol=1e-5)
    finally:
        torch._dynamo.reset()


def test_only_a_gpu_compiles_and_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(COMPILE_ENV, "1")
    assert compile_wanted(torch.device("cuda")) and not compile_wanted(torch.device("cpu"))
    monkeypatch.delenv(COMPILE_ENV)
    assert not compile_wanted(torch.device("cuda"))


def test_steps_that_cannot_compile_fail_at_once_naming_the_setting() -> None:
    torch._dynamo.reset()
    try:
        model = random_model(tiny_config(), torch.float32, "cpu")

        def broken(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable:
            raise RuntimeError("no C compiler")

        with pytest.raises(RuntimeError, match=f"{COMPILE_ENV}=1: the layers' steps do not compile on cpu"):
            model.compile_steps(backend=broken)
        assert model.steps is EAGER
    finally:
        torch._dynamo.reset()


def test_a_kernel_that_computes_something_else_fails_the_start_naming_lopa_kernels() -> None:
    from dataclasses import replace

    from lopa.kernels.dispatch import KERNELS_ENV
    from lopa.model.layer_steps import check_kernels
    from lopa.model.layer_steps import swiglu as reference_swiglu

    config = tiny_config()
    wrong = replace(EAGER, swiglu=lambda gate, up: reference_swiglu(gate, up) * 1.01)
    expected = (rf"^{KERNELS_ENV}: a layer kernel fails its check against the reference on cpu \(swiglu "
                rf"differs from its reference \(greatest difference 0\.\d+\)\); {KERNELS_ENV}=torch runs the "
                r"references$")
    with pytest.raises(RuntimeError, match=expected):
        check_kernels(wrong, config, torch.float32, torch.device("cpu"))
    check_kernels(EAGER, config, torch.float32, torch.device("cpu"))  # the references pass their own check


def test_lopa_kernels_is_checked_and_the_cpu_runs_the_references(monkeypatch: pytest.MonkeyPatch) -> None:
    from lopa.kernels.dispatch import KERNELS_ENV, uses_triton
    from lopa.model.layer_steps import kernels_wanted

    cpu = torch.device("cpu")
    assert not uses_triton(cpu) and not kernels_wanted(cpu)  # the default: Triton on a GPU only
    monkeypatch.setenv(KERNELS_ENV, "cuda")
    with pytest.raises(ValueError, match=f"{KERNELS_ENV}: must be one of triton, torch, interpret, got 'cu"):
        uses_triton(cpu)
