"""The decoding options beyond the paper's rules: `branch_score` (mean, block_min, fills) and
`branch_policy` (fixed, auto). Their defaults are the paper's; each option decides what its
docs/decoding.md paragraph says, checked on the real Decoder over a synthetic model."""

from __future__ import annotations

import math

import pytest
from synthetic_cases import RecordingExecutor, VerifyCall, generate, hash_choice, synthetic_model

from lopa.decoding import rules
from lopa.params import BranchPolicy, BranchScore, DecodingParams, InvalidParameter

PROMPT = [4, 2, 7, 1]
PARAMS = DecodingParams(block_size=6, max_new_tokens=36, tau_add=0.3, tau_act=0.8, conf="prob")


def test_the_defaults_are_the_papers_rules() -> None:
    params = DecodingParams()
    assert params.branch_score is BranchScore.MEAN and params.branch_policy is BranchPolicy.FIXED
    assert DecodingParams(branch_score="fills", branch_policy="auto").branch_policy is BranchPolicy.AUTO
    with pytest.raises(InvalidParameter, match="branch_score: must be one of mean, block_min, fills"):
        DecodingParams(branch_score="max")
    with pytest.raises(InvalidParameter, match="branch_policy: must be one of fixed, auto"):
        DecodingParams(branch_policy="more")


def test_block_min_is_the_least_confident_blocks_mean() -> None:
    assert rules.least_block_confidence([[-0.2, -0.4], [-1.0, -0.2], []]) == pytest.approx(-0.6)
    assert rules.least_block_confidence([[], []]) == 1.0  # nothing masked: complete


def test_fills_counts_the_lookahead_and_the_threshold_fills() -> None:
    assert rules.round_tokens([0.95, 0.50, 0.99, 0.90], 0.9, lookahead=True) == 3  # 0.90 is not above
    assert rules.round_tokens([0.95, 0.50], 0.9, lookahead=False) == 1
    assert rules.round_tokens([], 0.9, lookahead=False) == math.inf  # complete: it wins


@pytest.mark.parametrize(("ceiling", "filled", "spawned"), [(7, 0, 7), (7, 1, 4), (7, 2, 3), (7, 6, 1),
                                                             (3, 9, 1), (0, 0, 0)])
def test_auto_spawns_fewer_the_more_the_anchor_filled(ceiling: int, filled: int, spawned: int) -> None:
    assert rules.auto_branches(ceiling, filled) == spawned


def run(params: DecodingParams) -> tuple[list[VerifyCall], list[int]]:
    model = synthetic_model(hash_choice(len(PROMPT)))
    executor = RecordingExecutor(model)
    result, _ = generate(model, PROMPT, params, executor=executor)
    return executor.calls, result.output_ids


@pytest.mark.parametrize("options", [{"branch_score": "fills"}, {"branch_score": "block_min"},
                                     {"branch_policy": "auto"}, {"beta": 0.001}])
def test_no_option_changes_d2f(options: dict) -> None:
    """k = 0: one candidate a round, so no score or branch count can change anything."""
    assert run(PARAMS.with_overrides(**options))[1] == run(PARAMS)[1]


def block_of(call: VerifyCall, row: int, position: int) -> int:
    return call.windows[row].block_ids[position - call.start]


@pytest.mark.parametrize("kind", ["fills", "block_min"])
def test_the_winner_is_the_best_by_the_chosen_score(kind: str) -> None:
    params = PARAMS.with_overrides(branches=3, branch_score=kind)
    calls, _ = run(params)
    contested = 0
    for call in calls:
        rows = call.stats
        if kind == "fills":
            scores = [rules.round_tokens([s.prob for s in row], params.tau_conf, i < len(rows) - 1)
                      for i, row in enumerate(rows)]
        else:
            scores = [rules.least_block_confidence(
                [[s.conf for s in row if block_of(call, i, s.position) == b] for b in range(16)])
                for i, row in enumerate(rows)]
        assert call.committed == rules.pick_winner(scores)
        contested += len(set(scores)) > 1
    assert contested  # some rounds had a real choice


def test_the_options_change_the_decode_they_score() -> None:
    base = PARAMS.with_overrides(branches=3)
    paper = run(base)[1]
    assert run(base.with_overrides(branch_score="mean"))[1] == paper  # the default, named
    for kind in ("fills", "block_min"):
        assert run(base.with_overrides(branch_score=kind))[0] != run(base)[0], kind


def test_auto_spawns_after_each_round_as_its_anchor_filled() -> None:
    params = PARAMS.with_overrides(branches=3, branch_policy="auto")
    calls, _ = run(params)
    spawned = [len(call.windows) - 1 for call in calls]
    for before, after in zip(calls, spawned[1:], strict=False):
        winner = before.stats[before.committed]
        filled = sum(1 for s in winner if s.prob > params.tau_conf)
        assert after <= rules.auto_branches(params.branches, filled)  # fewer only when the pool is short
    fixed = [len(call.windows) - 1 for call in run(params.with_overrides(branch_policy="fixed"))[0]]
    assert sum(spawned) < sum(fixed) and max(spawned) == params.branches
