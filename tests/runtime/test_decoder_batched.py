"""One batched verification forward == verifying the candidates one at a time.

LocalExecutor pads ragged candidate rows into one [R, L] forward; RowByRowExecutor runs
one forward per row (each staging into its own slot). The decoder must pick the same
winners and produce the same tokens with either, on a synthetic model and on a small
random real checkpoint (fp32, CPU), including rounds where one candidate appended a block
the others did not (ragged rows, padding masked as keys and ignored in scoring).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from synthetic_cases import (
    MASK,
    RecordingModel,
    generate,
    hash_choice,
    synthetic_model,
)

from lopa.decoding.executor import BranchWindow, VerifyPart, verify_part
from lopa.execution.local import LocalExecutor, RowByRowExecutor
from lopa.params import AttentionMode, DecodingParams


def ragged_rounds(lengths: list[list[int]], block_size: int) -> int:
    """Forwards whose rows differ in length by exactly one block (a candidate appended one)."""
    return sum(1 for row in lengths if len(row) > 1 and max(row) - min(row) == block_size)


# -- synthetic -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("k", "temperature"), [(2, 0.0), (4, 0.0), (3, 0.7)])
def test_batched_equals_row_by_row_on_a_synthetic_model(k: int, temperature: float) -> None:
    """Greedy, and sampled with the same seed (both draw all rows' samples in one call)."""
    prompt = [4, 2, 7, 1, 9]
    params = DecodingParams(
        block_size=6, max_new_tokens=30, tau_add=0.5, tau_act=0.8, branches=k, temperature=temperature, seed=7
    )
    choice = hash_choice(len(prompt), eos_at=26)

    batched_model = RecordingModel(synthetic_model(choice))
    batched, batched_events = generate(batched_model, prompt, params, executor=LocalExecutor(batched_model))
    single_model = RecordingModel(synthetic_model(choice))
    single, single_events = generate(single_model, prompt, params, executor=RowByRowExecutor(single_model))

    assert batched.generated_ids == single.generated_ids
    assert batched.winners == single.winners
    assert batched.forwards == single.forwards == len(batched_model.lengths)
    assert [e.fills for e in batched_events] == [e.fills for e in single_events]
    # one forward per round batched, one per candidate row by row
    assert len(single_model.lengths) == sum(len(row) for row in batched_model.lengths)
    assert ragged_rounds(batched_model.lengths, params.block_size) > 0
    # the work the result reports is what the forwards ran: each row's own length, padding not counted
    assert batched.verified_tokens == single.verified_tokens == sum(map(sum, batched_model.lengths))
    assert batched.verified_tokens < sum(len(row) * max(row) for row in batched_model.lengths)  # padded
    assert any(w < e.candidates - 1 for w, e in zip(batched.winners, batched_events, strict=True))
    assert MASK not in batched.generated_ids


# -- a small random real checkpoint ----------------------------------------------------------------------


@pytest.fixture(scope="module", params=["dream", "llada"])
def real(request: pytest.FixtureRequest) -> Any:
    """A random checkpoint of each family (Dream's shifted logits, LLaDA's own-position ones)."""
    loader = pytest.importorskip("lopa.model.loader")
    name = "tiny_checkpoint" if request.param == "dream" else "tiny_llada_checkpoint"
    checkpoint = request.getfixturevalue(name)
    loaded = loader.load_model(checkpoint, dtype="float32")
    # The random head is near-uniform; sharpen it so that rounds mix threshold fills and
    # fallbacks and Conf values are well separated (no float-noise ties).
    loaded.model.lm_head.weight.mul_(16.0)
    return loaded


@pytest.mark.parametrize("attention", [AttentionMode.FULL, AttentionMode.BLOCK_CAUSAL])
def test_batched_equals_row_by_row_on_a_random_checkpoint(real: Any, attention: AttentionMode) -> None:
    prompt = [5, 17, 42, 8, 23, 61]
    params = DecodingParams(
        block_size=4,
        max_new_tokens=16,
        tau_add=0.5,
        tau_act=0.75,
        tau_conf=0.9,
        branches=3,
        attention=attention,
    )
    ids = {"mask_id": real.mask_token_id, "eos_ids": list(real.eos_token_ids), "max_length": 64}

    batched_model = RecordingModel(real.window_model(64))
    batched, _ = generate(batched_model, prompt, params, executor=LocalExecutor(batched_model), **ids)
    single_model = RecordingModel(real.window_model(64))
    single, _ = generate(single_model, prompt, params, executor=RowByRowExecutor(single_model), **ids)

    assert batched.generated_ids == single.generated_ids
    assert batched.winners == single.winners
    assert batched.forwards == single.forwards
    assert ragged_rounds(batched_model.lengths, params.block_size) > 0
    assert any(w != len(row) - 1 for w, row in zip(batched.winners, batched_model.lengths, strict=True))
    assert real.mask_token_id not in batched.generated_ids


def test_one_ragged_verify_matches_row_by_row_numerically(real: Any) -> None:
    """A single verification: three rows (the longest one appended a block), u = prompt.
    Statistics agree (tokens exactly, P/Conf to fp32 noise), the committed caches agree, and
    with Dream's shift, in the next u = 0 round position 6 uses the committed row's stored output
    (row 1's distribution for position 6, not row 2's)."""
    mask = real.mask_token_id
    prompt = [5, 17, 42, 8, 23, 61]
    rows = [
        [*prompt, 30, 31, mask, mask, *[mask] * 4],  # appended block 2
        [*prompt, mask, 31, mask, mask],
        [*prompt, mask, mask, mask, mask],
    ]
    windows = [
        BranchWindow(r, [0] * 6 + [1] * 4 + [2] * (len(r) - 10), [p for p, t in enumerate(r) if t == mask])
        for r in rows
    ]
    params = DecodingParams(branches=2)
    out = []
    for executor_type in (LocalExecutor, RowByRowExecutor):
        model = real.window_model(64)
        executor = executor_type(model)
        executor.begin(params, 3)
        first = verify_part(executor, VerifyPart(0, 0, len(prompt), windows))
        executor.commit_many([(0, 1)])
        cache = model.kv.cache[:, :, : model.cache_length()].clone()
        second = verify_part(executor, VerifyPart(0, 6, 0, [BranchWindow([mask] * 4, [1] * 4, [6, 7, 8, 9])]))
        out.append((first, cache, second))

    (first_b, cache_b, second_b), (first_s, cache_s, second_s) = out
    for stats_b, stats_s in ((first_b, first_s), (second_b, second_s)):
        for row_b, row_s in zip(stats_b, stats_s, strict=True):
            assert [(s.position, s.token) for s in row_b] == [(s.position, s.token) for s in row_s]
            assert [s.prob for s in row_b] == pytest.approx([s.prob for s in row_s], rel=1e-4, abs=1e-6)
            assert [s.conf for s in row_b] == pytest.approx([s.conf for s in row_s], rel=1e-4, abs=1e-6)
    assert cache_b.shape[2] == cache_s.shape[2] == len(prompt)
    torch.testing.assert_close(cache_b, cache_s, rtol=1e-4, atol=1e-5)
    if not real.config.logit_shift:
        return  # LLaDA reads position 6's own output in the second round: nothing was stored
    for first, second in ((first_b, second_b), (first_s, second_s)):
        committed_row, other_row = first[1][0], first[2][0]
        assert committed_row.position == other_row.position == second[0][0].position == 6
        assert (second[0][0].token, second[0][0].prob) == (committed_row.token, committed_row.prob)
        assert committed_row.prob != other_row.prob  # full attention: rows see different windows
