"""A synthetic model in which the filling order matters: forwards strictly fall as k grows.

The model (conf = prob, tau_conf = 0.9, alpha = 0, beta = 1, one block of 8 after a
3-token prompt). Generated positions, relative to the block start, and their P:

    rel  name  P                                   target
    0    g0    0.95 always                          11
    1    f1    0.95 once H is filled, else 0.30      12
    2    d2    0.95 once H is filled, else 0.70      13
    3    H     0.50 always (the hub)                 14
    4    d1    0.95 once H is filled, else 0.80      15
    5    f2    0.95 once H is filled, else 0.25      16
    6    d3    0.95 once H is filled, else 0.60      17
    7    f3    0.95 once H is filled, else 0.20      10

Every distribution depends only on whether H is filled, so the stale stored logit is
harmless (it is only ever used for the block's first position, g0, which every run fills
in round 1). The hub ranks 4th among the low positions (d1 > d2 > d3 > H > f1 > f2 > f3),
so a lookahead branch lands on it in round 2 only when k >= 4; the decoys d1..d3 unlock
nothing, and filling one of them removes an above-average P from the mean, so a decoy
branch always scores below the base. A branch holding H scores 0.95 and always wins.

Scores (mean P over each candidate's masked positions), after round 1 filled g0:

    state when verified   base                 L(d1)   L(d2)   L(d3)   L(H)
    nothing else filled   3.35/7 = 0.4786      0.4250  0.4417  0.4583  0.95
    d1 filled             2.55/6 = 0.4250      -       0.3700  0.3900  0.95
    d1, d2 filled         1.85/5 = 0.3700      -       -       0.3125  0.95
    d1, d2, d3 filled     1.25/4 = 0.3125      -       -       -       0.95

Candidate order is [L1..Lk, base], lookaheads in spawn (rank) order. Round by round:

k = 0 (D2F): R1 fills g0 (0.95 > 0.9; the fill set is not empty, so no fallback).
    R2..R5: nothing exceeds 0.9, the (fully activated) block's fallback fills the best P:
    d1, d2, d3, then H (0.50 beats the f's). R6: f1, f2, f3 are 0.95 -> filled. 6 forwards.
k = 1: R1 fills g0, spawns L1 at d1. R2 [L(d1) .4250, base .4786] -> base; fallback d1;
    spawn d2. R3 [L(d2) .37, base .425] -> base; fallback d2; spawn d3. R4 [L(d3) .3125,
    base .37] -> base; fallback d3; spawn H. R5 [L(H) .95, base .3125] -> L1; the anchor
    fill on its logits fills f1 f2 f3. 5 forwards, winners [0, 1, 1, 1, 0].
k = 2: R1 spawns d1, d2. R2 [L(d1), L(d2), base] -> base; fallback d1; spawn d2, d3.
    R3 [L(d2) .37, L(d3) .39, base .425] -> base; fallback d2; spawn d3, H.
    R4 [L(d3) .3125, L(H) .95, base .37] -> L2; anchor fills d3 f1 f2 f3.
    4 forwards, winners [0, 2, 2, 1].
k = 3: R1 spawns d1 d2 d3. R2 -> base (.4786 beats .4250/.4417/.4583); fallback d1;
    spawn d2 d3 H. R3 [L(d2) .37, L(d3) .39, L(H) .95, base .425] -> L3; anchor fills
    d2 d3 f1 f2 f3. 3 forwards, winners [0, 3, 2].
k = 4: R1 spawns d1 d2 d3 H. R2 -> L4 (.95); anchor fills everything left.
    2 forwards, winners [0, 3].
k = 5: R1 also spawns f1 (L(f1) = 3.05/6 = .5083 beats the base but not L(H)); the same
    as k = 4: 2 forwards, winners [0, 3]. Nothing is left to gain.

After the last fill the block is complete (TO_CACHE); the next round adds no block
(max_new_tokens = one block) and stops without a forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from synthetic_cases import (
    MASK,
    RecordingExecutor,
    filled,
    generate,
    synthetic_model,
)

from lopa.params import DecodingParams

PROMPT = [1, 2, 3]
START = len(PROMPT)
NAMES = ["g0", "f1", "d2", "H", "d1", "f2", "d3", "f3"]
POS = {name: START + rel for rel, name in enumerate(NAMES)}
TARGET = {"g0": 11, "f1": 12, "d2": 13, "H": 14, "d1": 15, "f2": 16, "d3": 17, "f3": 10}
LOW = {"f1": 0.30, "d2": 0.70, "d1": 0.80, "f2": 0.25, "d3": 0.60, "f3": 0.20}


def hub_choice(sequence: Sequence[int], position: int) -> tuple[int, float] | None:
    rel = position - START
    if not 0 <= rel < len(NAMES):
        return None
    name = NAMES[rel]
    if name == "g0":
        return TARGET[name], 0.95
    if name == "H":
        return TARGET[name], 0.50
    return TARGET[name], 0.95 if filled(sequence, POS["H"]) else LOW[name]


PARAMS = DecodingParams(block_size=8, max_new_tokens=8, tau_conf=0.9, conf="prob", alpha=0.0, beta=1.0)
EXPECTED_TOKENS = [TARGET[name] for name in NAMES]

# k -> (forwards, winners, lookahead positions verified in each round, fills committed each round)
EXPECTED = {
    0: (6, [0] * 6, [[]] * 6, [["g0"], ["d1"], ["d2"], ["d3"], ["H"], ["f1", "f2", "f3"]]),
    1: (
        5,
        [0, 1, 1, 1, 0],
        [[], ["d1"], ["d2"], ["d3"], ["H"]],
        [["g0"], ["d1"], ["d2"], ["d3"], ["f1", "H", "f2", "f3"]],
    ),
    2: (
        4,
        [0, 2, 2, 1],
        [[], ["d1", "d2"], ["d2", "d3"], ["d3", "H"]],
        [["g0"], ["d1"], ["d2"], ["f1", "H", "f2", "d3", "f3"]],
    ),
    3: (
        3,
        [0, 3, 2],
        [[], ["d1", "d2", "d3"], ["d2", "d3", "H"]],
        [["g0"], ["d1"], ["f1", "d2", "H", "f2", "d3", "f3"]],
    ),
    4: (2, [0, 3], [[], ["d1", "d2", "d3", "H"]], [["g0"], ["f1", "d2", "H", "d1", "f2", "d3", "f3"]]),
    5: (2, [0, 3], [[], ["d1", "d2", "d3", "H", "f1"]], [["g0"], ["f1", "d2", "H", "d1", "f2", "d3", "f3"]]),
}


def lookahead_names(call_windows: list, base_index: int) -> list[str]:
    """Per lookahead row: the one position it holds that the base row still has masked."""
    base = call_windows[base_index]
    names = []
    for window in call_windows[:base_index]:
        extra = [p for p in base.masked if p not in window.masked]
        assert len(extra) == 1, "a lookahead branch differs from the base by exactly one token"
        names.append(NAMES[extra[0] - START])
    return names


@pytest.mark.parametrize("k", sorted(EXPECTED))
def test_forwards_fall_as_k_grows(k: int) -> None:
    forwards, winners, lookaheads, fills = EXPECTED[k]
    model = synthetic_model(hub_choice)
    executor = RecordingExecutor(model)
    result, events = generate(model, PROMPT, PARAMS.with_overrides(branches=k), executor=executor)

    assert result.forwards == forwards == model.forward_calls
    assert result.generated_ids == EXPECTED_TOKENS
    assert result.output_ids == EXPECTED_TOKENS
    assert result.winners == winners
    assert [lookahead_names(c.windows, len(c.windows) - 1) for c in executor.calls] == lookaheads
    assert [[NAMES[p - START] for p, _ in e.fills] for e in events] == fills
    assert [e.candidates for e in events] == [len(c.windows) for c in executor.calls]
    assert MASK not in result.generated_ids


def test_counts_strictly_decrease_then_saturate() -> None:
    """The headline: 6, 5, 4, 3, 2 forwards for k = 0..4, then no further gain."""
    counts = [
        generate(synthetic_model(hub_choice), PROMPT, PARAMS.with_overrides(branches=k))[0].forwards
        for k in range(6)
    ]
    assert counts == [6, 5, 4, 3, 2, 2]
