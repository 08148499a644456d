"""The model on the kernels (LOPA_KERNELS=interpret: the Triton steps on the CPU, interpreted)
against the model on the references: lone and batched rounds through the graph path (uncaptured;
the rotary kernel stages a batched round's K/V straight into its buffer).

The kernel steps compute in another order than the references, so the two agree to rounding
(1e-4), as the graph path and the eager path do (tests/runtime/test_model_round_graphs.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from round_cases import MAX_LENGTH, play_rounds

from lopa.bundled import tasks
from lopa.decoding.decoder import Decoder
from lopa.decoding.executor import BranchWindow, VerifyPart
from lopa.engine import bundled_model_dir
from lopa.execution.local import LocalExecutor
from lopa.kernels.dispatch import KERNELS_ENV
from lopa.model import WindowedLM
from lopa.model.cuda_graphs import WindowGraphs
from lopa.model.decoding_defaults import model_defaults
from lopa.model.layer_steps import EAGER
from lopa.model.loader import LoadedModel, load_model
from lopa.scheduling.alone import decode_alone

ROUNDS = [[0, 1, 2], [1]]  # a batched round, then a lone one over the cache it committed


def _on_kernels(monkeypatch: pytest.MonkeyPatch) -> WindowedLM:
    monkeypatch.setenv(KERNELS_ENV, "interpret")
    model = load_model(bundled_model_dir()).model
    window = WindowedLM(model, MAX_LENGTH, max_batch=4)
    assert model.steps.kernels, "the window model did not take the kernel steps"
    window.graphs = WindowGraphs(model, window._physical, window.kv_storage, capture=False)
    return window


def test_rounds_on_the_kernels_equal_rounds_on_the_references(monkeypatch: pytest.MonkeyPatch) -> None:
    references = WindowedLM(load_model(bundled_model_dir()).model, MAX_LENGTH, max_batch=4)
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
    assert kernels.graphs is not None and {b.requests for b in kernels.graphs.graphs} == {1, 3}


def _decode(loaded: LoadedModel, window: WindowedLM) -> list[list[int]]:
    executor = LocalExecutor(window, pad_id=loaded.special.pad)
    decoder = Decoder(executor, loaded.special.mask, loaded.special.eos, MAX_LENGTH)
    params = model_defaults(bundled_model_dir()).with_overrides(branches=3)
    return [decode_alone(decoder, loaded.tokenizer.encode(e.prompt), params).generated_ids
            for e in tasks.held_out(2)]


def test_greedy_decoding_through_the_vocabulary_pass_equals_the_references(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The executor takes each round's statistics from the model's vocabulary kernel (no logits
    for the masked positions) and decodes the same tokens as from the logits."""
    references = load_model(bundled_model_dir())
    plain = references.window_model(MAX_LENGTH)
    monkeypatch.setenv(KERNELS_ENV, "interpret")
    kernels = load_model(bundled_model_dir())
    fused = kernels.window_model(MAX_LENGTH)
    kernels.model.steps = EAGER  # the layers on the references (the test above runs their kernels)
    assert fused.vocab_pass and not plain.vocab_pass
    passes: list[int] = []
    forward_many_stats = fused.forward_many_stats

    def counting(*args: object) -> object:
        passes.append(1)
        return forward_many_stats(*args)

    fused.forward_many_stats = counting  # type: ignore[method-assign]
    assert _decode(kernels, fused) == _decode(references, plain)
    assert passes  # the rounds took the vocabulary pass


def test_first_rounds_of_one_prompt_share_the_vocabulary_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two greedy requests of one prompt in their first round: one forward through the vocabulary
    pass, the second request takes its statistics and a copy of its staging, and both commit the
    K/V the request alone commits."""
    monkeypatch.setenv(KERNELS_ENV, "interpret")
    kernels = load_model(bundled_model_dir())
    kernels.model.steps = EAGER
    prompt = kernels.tokenizer.encode(tasks.held_out(1)[0].prompt)
    mask = kernels.special.mask
    window = BranchWindow([*prompt, *[mask] * 8], [0] * len(prompt) + [1] * 8,
                          list(range(len(prompt), len(prompt) + 8)))
    params = model_defaults(bundled_model_dir())
    outcomes = []
    for sequences in ([0, 1], [0]):
        executor = LocalExecutor(kernels.window_model(MAX_LENGTH, max_batch=2))
        assert executor.model.vocab_pass
        for sequence in sequences:
            executor.begin(params, 1, sequence)
        parts = [VerifyPart(s, 0, len(prompt), [window]) for s in sequences]
        outcomes.append(executor.verify_many(parts))
        executor.commit_many([(s, 0) for s in sequences])
        assert all(executor.model.cache_length(s) == len(prompt) for s in sequences)
    (first, second), (alone,) = outcomes
    assert first == second == alone
