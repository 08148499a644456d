"""Requests of one prompt starting together share their first forward (lopa.execution.twins): the
prompt's K/V computed once and copied; every request's answer is still the one it gets alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lopa.bundled import bundled_llada_dir, tasks
from lopa.engine import LocalEngine, bundled_model_dir
from lopa.execution.twins import first_round_twins, for_every_batch, leaders_only
from lopa.model.decoding_defaults import model_defaults
from lopa.model.kv_cache import KVCache
from lopa.model.protocol import WindowBatch
from lopa.params import AttentionMode
from lopa.scheduling.request import Request, Waiter


def _batch(tokens: list[int], start: int = 0, sequence: int = 0, n_stage: int = 3,
           mode: AttentionMode = AttentionMode.BLOCK_CAUSAL) -> WindowBatch:
    ids = torch.tensor([tokens])
    return WindowBatch(ids, [len(tokens)], torch.zeros_like(ids), start, n_stage, mode, sequence=sequence)


def test_twins_are_first_rounds_of_the_same_rows() -> None:
    batches = [
        _batch([1, 2, 3, 9, 9], sequence=0),
        _batch([1, 2, 3, 9, 9], sequence=1),  # twin of 0
        _batch([1, 2, 4, 9, 9], sequence=2),  # another prompt
        _batch([1, 2, 3, 9, 9], sequence=3, start=5),  # not a first round
        _batch([1, 2, 3, 9, 9], sequence=4, mode=AttentionMode.FULL),  # another attention
        _batch([1, 2, 3, 9, 9], sequence=5, n_stage=2),  # another layout
        _batch([1, 2, 3, 9, 9], sequence=6),  # twin of 0
    ]
    twins = first_round_twins(batches)
    assert twins == {1: 0, 6: 0}
    assert [b.sequence for b in leaders_only(batches, twins)] == [0, 2, 3, 4, 5]
    assert for_every_batch(["a", "c", "d", "e", "f"], 7, twins) == ["a", "a", "c", "d", "e", "f", "a"]
    reduced = [(2, "prob")] * 6 + [(2, "margin")]  # the model's statistics differ: no twin
    assert first_round_twins(batches, reduced) == {1: 0}


@pytest.mark.parametrize("n", [3, 80])  # in the staging area; longer than it (in the cache's tail)
def test_a_copy_of_the_staged_kv_commits_what_the_original_does(n: int) -> None:
    source, target = (KVCache(2, 2, 4, 128, num_slots=2) for _ in range(2))
    rows = 1 if n > source.staging_capacity else 2
    source.begin_stage(rows, n)
    for layer in range(2):
        source.stage(layer, torch.randn(rows, n + 1, 2, 4), torch.randn(rows, n + 1, 2, 4))
    target.stage_copy_of(source)
    assert [target.staged_count(s) for s in range(rows)] == [n] * rows
    assert torch.equal(target.pack_staged(rows - 1, n), source.pack_staged(rows - 1, n))
    target.commit(rows - 1, n)
    source.commit(rows - 1, n)
    assert torch.equal(target.cached(1)[0], source.cached(1)[0])
    with pytest.raises(ValueError, match="not empty"):
        target.stage_copy_of(source)


@pytest.mark.parametrize("family", ["dream", "llada"])  # a shifted head's stored logit; none
def test_samples_of_one_prompt_share_the_first_forward_and_answer_as_alone(family: str) -> None:
    directory = bundled_model_dir() if family == "dream" else bundled_llada_dir()
    # Every branch granted (no budget): each request's rounds as alone.
    engine = LocalEngine.from_dirs(directory, max_batch=8, max_step_tokens=100_000)
    model = engine.window_model
    copies: list[tuple[int, int]] = []
    copy_staged = model.copy_staged

    def recorded(source: int, target: int) -> None:
        copies.append((source, target))
        copy_staged(source, target)

    model.copy_staged = recorded  # the real copy, recorded
    try:
        base = model_defaults(directory).with_overrides(branches=3)
        prompt, other = (engine.encode(e.prompt) for e in tasks.held_out(2))
        sampled = [base.with_overrides(temperature=1.5, seed=40 + j) for j in range(4)]
        asks = [(prompt, p) for p in sampled] + [(other, sampled[0]), (prompt, base), (prompt, base)]
        asks.append((prompt, dataclasses.replace(base, block_size=base.block_size * 2)))  # another layout
        waiters = [Waiter() for _ in asks]
        engine.scheduler.submit_many([Request(ids, p, on_done=w) for (ids, p), w in zip(asks, waiters,
                                                                                          strict=True)])
        engine.scheduler.start()
        together = [w.wait() for w in waiters]
        # Every request of the prompt with the same block layout takes the first one's forward,
        # sampled or greedy: the forward does not depend on how its logits are decided.
        assert copies == [(0, 1), (0, 2), (0, 3), (0, 5), (0, 6)]
        alone = [engine.generate(ids, p) for ids, p in asks]
        assert [c.result.generated_ids for c in together] == [c.result.generated_ids for c in alone]
        assert [c.result.forwards for c in together] == [c.result.forwards for c in alone]
        assert len({c.text for c in together[:4]}) > 1  # the samples differ: their own seeds
        assert len(copies) == 5  # alone, none shares
    finally:
        engine.close()
