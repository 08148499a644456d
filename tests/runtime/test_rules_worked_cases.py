"""docs/decoding.md section 7: every worked case, on the pure rules."""

from __future__ import annotations

import math

import pytest
import torch

from lopa.decoding import rules
from lopa.decoding.blocks import Block, BlockState, Branch, SequenceConstants
from lopa.decoding.rules import PositionStat
from lopa.execution.sampling import confidence, position_stats
from lopa.params import ConfKind, DecodingParams

MASK = 99


def stats_from_probs(ps: list[float]) -> list[PositionStat]:
    return [PositionStat(position=i, token=1, prob=p, conf=p) for i, p in enumerate(ps)]


def test_fill_is_strictly_above_threshold() -> None:
    fills = rules.select_fills(stats_from_probs([0.97, 0.50, 0.92, 0.30, 0.90]), 0.9, fully_activated=True)
    assert [f.position for f in fills] == [0, 2]


FALLBACK_DISTRIBUTIONS = [(0.80, 0.10, 0.10), (0.75, 0.25, 0.0), (0.60, 0.40, 0.0)]


@pytest.mark.parametrize(("kind", "filled"), [("prob", 0), ("neg_entropy", 1), ("margin", 0)])
def test_fallback_depends_on_conf(kind: str, filled: int) -> None:
    params = DecodingParams(conf=kind)
    logits = torch.log(torch.tensor(FALLBACK_DISTRIBUTIONS))
    tokens, probs, confs = position_stats(logits, params)
    stats = [PositionStat(i, int(tokens[i]), float(probs[i]), float(confs[i])) for i in range(3)]
    assert [f.position for f in rules.select_fills(stats, 0.9, fully_activated=True)] == [filled]
    assert rules.select_fills(stats, 0.9, fully_activated=False) == []


def test_neg_entropy_values_of_the_fallback_case() -> None:
    probs = torch.tensor(FALLBACK_DISTRIBUTIONS)
    values = confidence(probs, probs.max(-1).values, ConfKind.NEG_ENTROPY).tolist()
    assert values == pytest.approx([-0.6390, -0.5623, -0.6730], abs=1e-4)


def branch_with_last_block_decoded(decoded: int, size: int = 32) -> Branch:
    branch = Branch.from_prompt([1, 2, 3])
    branch.blocks[0].state = BlockState.IN_CACHE
    tokens = [5] * decoded + [MASK] * (size - decoded)
    branch.tokens.extend(tokens)
    branch.blocks.append(Block(3, 3 + size, BlockState.ACTIVE))
    return branch


def consts(block_size: int = 32, max_blocks: int = 10, max_length: int = 1000) -> SequenceConstants:
    return SequenceConstants(MASK, frozenset({0}), block_size, max_blocks, max_length)


@pytest.mark.parametrize(("tau_add", "no", "yes"), [(0.1, 3, 4), (0.3, 9, 10)])
def test_block_add_threshold(tau_add: float, no: int, yes: int) -> None:
    assert not rules.maybe_add_block(branch_with_last_block_decoded(no), consts(), tau_add)
    grown = branch_with_last_block_decoded(yes)
    assert rules.maybe_add_block(grown, consts(), tau_add)
    assert grown.blocks[-1].start == 35 and grown.blocks[-1].size == 32
    assert grown.tokens[35:] == [MASK] * 32


@pytest.mark.parametrize(("tau_act", "needed"), [(0.95, 31), (0.90, 29), (0.70, 23)])
def test_activation_threshold(tau_act: float, needed: int) -> None:
    for decoded, expected in ((needed - 1, False), (needed, True)):
        branch = branch_with_last_block_decoded(decoded)
        rules.maybe_add_block(branch, consts(), 0.0)
        rules.update_activation(branch, MASK, tau_act)
        assert branch.blocks[2].fully_activated is expected


def layout_branch() -> Branch:
    branch = Branch(
        tokens=[1] * 5 + [2] * 8 + [3] * 8 + [MASK] * 8,
        blocks=[
            Block(0, 5, BlockState.IN_CACHE, True),
            Block(5, 13, BlockState.IN_CACHE, True),
            Block(13, 21, BlockState.TO_CACHE, True),
            Block(21, 29, BlockState.ACTIVE, True),
        ],
    )
    return branch


def test_layout_case() -> None:
    branch = layout_branch()
    assert rules.completed_prefix_end(branch) == 21
    assert rules.to_cache_length(branch) == 8
    assert rules.window_start(branch) == 13
    assert rules.masked_positions(branch, MASK) == list(range(21, 29))


def neg_entropy(dist: tuple[float, ...]) -> float:
    return sum(p * math.log(p + 1e-10) for p in dist)


SCORE_CONFS = [neg_entropy(d) for d in [(0.97, 0.03), (0.9, 0.1), (0.6, 0.4), (0.5, 0.5)]]


@pytest.mark.parametrize(
    ("alpha", "beta", "creation", "expected"),
    [(0.0, 1.0, 1.0, -0.4565), (0.0, 0.5, 1.0, -0.6831), (0.5, 0.5, -0.05, -0.3665)],
)
def test_score_case(alpha: float, beta: float, creation: float, expected: float) -> None:
    assert rules.branch_score(SCORE_CONFS, creation, alpha, beta) == pytest.approx(expected, abs=1e-4)


def test_score_without_masks_is_plus_one() -> None:
    assert rules.branch_score([], 1.0, 0.0, 1.0) == 1.0


@pytest.mark.parametrize(
    ("scores", "winner"),
    [([-0.40, -0.35, -0.35, -0.30], 3), ([-0.40, -0.35, -0.35, -0.36], 1)],
)
def test_winner_case_and_ties_to_earlier(scores: list[float], winner: int) -> None:
    assert rules.pick_winner(scores) == winner


def test_base_loses_ties() -> None:
    assert rules.pick_winner([-0.3, -0.5, -0.3]) == 0


def test_spawn_case() -> None:
    stats = [
        PositionStat(40, 7, 0.5, -0.20),
        PositionStat(41, 7, 0.5, -1.50),
        PositionStat(47, 7, 0.5, -0.05),
        PositionStat(52, 7, 0.5, -0.90),
    ]
    assert [s.position for s in rules.spawn_positions(stats, 2)] == [47, 40]


def test_spawn_is_stable_by_position_on_equal_conf() -> None:
    stats = [PositionStat(p, 7, 0.5, -0.5) for p in (44, 42, 43)]
    assert [s.position for s in rules.spawn_positions(stats, 2)] == [42, 43]
