"""The model on the kernels (LOPA_KERNELS=interpret: the Triton steps on the CPU, interpreted)
against the model on the references: lone and batched rounds through the graph path (uncaptured;
the rotary kernel stages a batched round's K/V straight into its buffer).

The kernel steps compute in another order than the references, so the two agree to rounding
(1e-4), as the graph path and the eager path do (tests/runtime/test_model_round_graphs.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from round_cases import MAX_LENGTH, play_rounds

from lopa.engine import bundled_model_dir
from lopa.kernels.dispatch import KERNELS_ENV
from lopa.model import DreamWindowModel
from lopa.model.cuda_graphs import WindowGraphs
from lopa.model.loader import load_model

ROUNDS = [[0, 1, 2], [1], [2, 0]]


def _on_kernels(monkeypatch: pytest.MonkeyPatch) -> DreamWindowModel:
    monkeypatch.setenv(KERNELS_ENV, "interpret")
    model = load_model(bundled_model_dir()).model
    window = DreamWindowModel(model, MAX_LENGTH, max_batch=4)
    assert model.steps.kernels, "the window model did not take the kernel steps"
    window.graphs = WindowGraphs(model, window._physical, window.kv_storage, capture=False)
    return window


def test_rounds_on_the_kernels_equal_rounds_on_the_references(monkeypatch: pytest.MonkeyPatch) -> None:
    references = DreamWindowModel(load_model(bundled_model_dir()).model, MAX_LENGTH, max_batch=4)
    assert not references.model.steps.kernels
    kernels = _on_kernels(monkeypatch)
    staged: list[bool] = []
    steps = kernels.model.steps
    assert steps.rotary_qkv is not None
    rotary_qkv = steps.rotary_qkv

    def recording(*args: object) -> object:
        staged.append(len(args) > 5 and args[5] is not None)
        return rotary_qkv(*args)

    kernels.model.steps = replace(steps, rotary_qkv=recording)
    play_rounds(references, kernels, ROUNDS)
    assert any(staged) and not all(staged)  # batched rounds stage their K/V in the kernel, lone ones not
    assert kernels.graphs is not None and {b.requests for b in kernels.graphs.graphs} == {1, 2, 3}
