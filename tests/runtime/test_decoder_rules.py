"""Decoder-level tests of the rules that are easy to get wrong (docs/decoding.md sections 2-4, 6).

Every test drives the real Decoder / LocalExecutor over a SyntheticModel whose confidences
are chosen by hand, and asserts exact per-round fills, winners and forward counts. Unless
a test says otherwise, distributions are context-free (so the stale stored logit equals
the fresh one) and conf = prob, so P and Conf coincide.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from synthetic_cases import (
    EOS,
    MASK,
    MAX_LENGTH,
    RecordingExecutor,
    filled,
    generate,
    hash_choice,
    synthetic_model,
)

from lopa.decoding import rules
from lopa.decoding.blocks import Block, BlockState, Branch
from lopa.decoding.decoder import Decoder
from lopa.decoding.executor import BranchWindow, VerifyPart, verify_part
from lopa.execution.local import LocalExecutor
from lopa.params import DecodingParams

PROMPT = [1, 2, 3]  # generated positions start at 3


def target(position: int) -> int:
    return position % 10 + 1  # never MASK (19) nor EOS (18)


def fills_per_step(events: Sequence) -> list[list[int]]:
    return [[p for p, _ in e.fills] for e in events]


# -- (a) the fallback: fully activated blocks only, one per block ----------------------------------


def descending_choice(sequence: Sequence[int], position: int) -> tuple[int, float] | None:
    """P falls with the position (0.80, 0.79, ...), except position 9 which is always 0.95."""
    if position < len(PROMPT):
        return None
    return target(position), 0.95 if position == 9 else 0.80 - 0.01 * (position - 3)


def test_fallback_only_in_fully_activated_blocks_one_per_block() -> None:
    """B=4, tau_add 0.25, tau_act 0.75: block 2 is appended semi-activated in round 2 and
    only becomes fully activated in round 4 (block 1 at 3/4).

    R1 [3]: block 1's fallback (its best P, 0.80).
    R2 [4, 9]: block 2 appended semi-activated; block 1 falls back to 4; block 2 gets only its
        threshold fill (9, P 0.95) and no fallback.
    R3 [5]: block 3 appended (block 2 at 1/4), semi; blocks 2 and 3 have nothing > 0.9: nothing.
    R4 [6, 7]: block 2 now fully activated: one fallback in block 1 AND one in block 2.
    R5 [8]: block 1 is being cached; block 3 still semi (block 2 at 2/4) gets nothing.
    R6 [10, 11]: block 3 fully activated: one fallback each in blocks 2 and 3.
    R7..R9 [12], [13], [14]; then block 3 is complete and the next round stops: 9 forwards.
    """
    params = DecodingParams(block_size=4, max_new_tokens=12, tau_add=0.25, tau_act=0.75, conf="prob")
    model = synthetic_model(descending_choice)
    result, events = generate(model, PROMPT, params)

    assert fills_per_step(events) == [[3], [4, 9], [5], [6, 7], [8], [10, 11], [12], [13], [14]]
    assert result.forwards == 9
    assert [len(e.tokens) for e in events] == [7, 11, 15, 15, 15, 15, 15, 15, 15]
    assert result.generated_ids == [target(p) for p in range(3, 15)]


# -- (b) the fill threshold is strict ------------------------------------------------------------


def certain_choice(sequence: Sequence[int], position: int) -> tuple[int, float] | None:
    return None if position < len(PROMPT) else (target(position), 1.0)  # P is exactly 1.0


def test_threshold_is_strict_at_the_decoder() -> None:
    """Every P is exactly 1.0 (one-hot logits) and tau_conf = 1.0: nothing is > tau_conf, so
    each round fills one position by the fallback (ties: the earliest). With >= the whole
    block would fill in one forward."""
    params = DecodingParams(block_size=4, max_new_tokens=4, tau_conf=1.0, conf="prob")
    result, events = generate(synthetic_model(certain_choice), PROMPT, params)
    assert fills_per_step(events) == [[3], [4], [5], [6]]
    assert result.forwards == 4

    below = params.with_overrides(tau_conf=0.999)
    result, events = generate(synthetic_model(certain_choice), PROMPT, below)
    assert fills_per_step(events) == [[3, 4, 5, 6]]
    assert result.forwards == 1


# -- (c) TO_CACHE only from the anchor's completions ------------------------------------------------


def lookahead_completes_choice(sequence: Sequence[int], position: int) -> tuple[int, float] | None:
    """Block 1 [3,7): 3-5 at 0.95, 6 at 0.60. Block 2 [7,11): 0.95 once 6 is filled, else 0.50.
    Block 3 [11,15): 0.95."""
    if position < len(PROMPT):
        return None
    if position == 6:
        return target(position), 0.60
    if 7 <= position < 11:
        return target(position), 0.95 if filled(sequence, 6) else 0.50
    return target(position), 0.95


PROMOTION_PARAMS = DecodingParams(
    block_size=4, max_new_tokens=12, tau_add=0.5, tau_act=0.5, conf="prob", branches=1
)


def test_block_completed_by_a_lookahead_stays_active_until_an_anchor_fill() -> None:
    """Drive the decoder's own round functions.

    R1: fills 3, 4, 5; spawns L1 at 6. L1's block 1 now has 0 masks but stays ACTIVE: only
    the base's anchor fill may promote it. R2: L1 wins (block 2 is 0.95 in L1, mean 0.95 vs
    the base's 0.52); the anchor fill on L1's logits fills block 2 and sees blocks 1 and 2
    complete -> both TO_CACHE in the next base, cached together in round 3.
    """
    model = synthetic_model(lookahead_completes_choice)
    executor = RecordingExecutor(model)
    decoder = Decoder(executor, MASK, [EOS], MAX_LENGTH)
    params = PROMOTION_PARAMS
    generation = decoder.start(PROMPT, params)
    executor.begin(params, params.branches + 1)

    def run_round() -> int:
        assert generation.plan() is not None
        verify = generation.verify(params.branches)
        part = VerifyPart(0, verify.start, verify.n_stage, verify.windows)
        winner = generation.apply(verify_part(executor, part))
        executor.commit_many([(0, winner)])
        return winner

    run_round()
    lookahead, base = generation._candidates
    assert lookahead.lookahead_position == 6
    assert lookahead.masks_left(lookahead.blocks[1], MASK) == 0
    assert lookahead.blocks[1].state is BlockState.ACTIVE
    assert base.masks_left(base.blocks[1], MASK) == 1
    assert base.blocks[1].state is BlockState.ACTIVE

    assert generation.plan() is not None
    assert [len(c.blocks) for c in generation._candidates] == [3, 3]  # both appended block 2
    assert run_round() == 0
    assert executor.calls[-1].n_stage == 0  # block 1 was NOT cached in round 2
    candidates = generation._candidates
    assert len(candidates) == 1  # nothing masked: no lookahead
    assert [b.state for b in candidates[0].blocks] == [
        BlockState.IN_CACHE,
        BlockState.TO_CACHE,
        BlockState.TO_CACHE,
    ]


def test_lookahead_completed_block_is_cached_one_round_later_end_to_end() -> None:
    """The same scenario through generate(): u per forward is [3 (prompt), 0, 8 (blocks 1+2)],
    and the window start always equals the cache length (the SyntheticModel asserts it)."""
    model = synthetic_model(lookahead_completes_choice)
    executor = RecordingExecutor(model)
    result, events = generate(model, PROMPT, PROMOTION_PARAMS, executor=executor)
    assert [(c.start, c.n_stage) for c in executor.calls] == [(0, 3), (3, 0), (3, 8)]
    assert result.winners == [0, 0, 0]
    assert fills_per_step(events) == [[3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14]]
    assert result.forwards == 3
    assert model.cache_length() == 11  # block 3 is TO_CACHE when generation stops


# -- (d) the stored last logit comes from the winner ------------------------------------------------

X, W, Y, Z = 11, 12, 13, 14  # the token position 8 predicts, by which of 10/11 are filled


def stored_logit_choice(sequence: Sequence[int], position: int) -> tuple[int, float] | None:
    """B=5. Block 1 [3,8): 3-6 at 0.95, 7 at 0.40. Block 2 [8,13):
    8: P 0.30 on Z (10 and 11 filled), X (11 only), W (10 only), else Y;
    9: 0.95; 10: 0.95 once 11 is filled, else 0.60; 11: 0.55; 12: 0.10 once 10 is filled, else 0.20.
    """
    if position < len(PROMPT):
        return None
    if position < 7:
        return target(position), 0.95
    if position == 7:
        return target(position), 0.40
    if position == 8:
        ten, eleven = filled(sequence, 10), filled(sequence, 11)
        return (Z if ten and eleven else X if eleven else W if ten else Y), 0.30
    if position == 9:
        return target(position), 0.95
    if position == 10:
        return target(position), 0.95 if filled(sequence, 11) else 0.60
    if position == 11:
        return target(position), 0.55
    return target(position), 0.10 if filled(sequence, 10) else 0.20


def test_stored_last_logit_is_the_winners() -> None:
    """k=2, tau_add = tau_act = 0.7.

    R1 (u=3): fills 3-6; spawns L1 at 7 (the only mask).
    R2 (u=0): both candidates append block 2. L1 (block 2 masks: .30 .95 .60 .55 .20 -> .52)
        beats the base (.40 more -> .50). Anchor fills 9; block 1 -> TO_CACHE; spawns at 10
        (.60) and 11 (.55).
    R3 (u=5, block 1 cached): rows L1(10) [8: W .30, 11 .55, 12 .10] = .3167, L2(11)
        [8: X .30, 10 .95, 12 .20] = .4833, base [8: Y, 10, 11, 12] = .4125 -> L2 (the middle
        row) wins. The raw output at u-1 (position 8's distribution) differs per row: the
        stored last logit must become L2's (X). Anchor fills 10; spawns at 8 (X) and 12.
    R4 (u=0, window starts AT 8, so 8 uses the stored logit): L1(8) [12 .10] = .10,
        L2(12) [8 .30] = .30, base [8, 12] = .20 -> L2; its block-2 fallback fills 8 from the
        stored logit: X. Row 0's logit would give W, the base row's Y, a fresh output Z,
        and a stale one from the prompt forward the token of position 3.
    """
    params = DecodingParams(
        block_size=5, max_new_tokens=10, tau_add=0.7, tau_act=0.7, conf="prob", branches=2
    )
    model = synthetic_model(stored_logit_choice)
    executor = RecordingExecutor(model)
    result, events = generate(model, PROMPT, params, executor=executor)

    assert [(c.start, c.n_stage) for c in executor.calls] == [(0, 3), (3, 0), (3, 5), (8, 0)]
    assert result.winners == [0, 0, 1, 1]
    assert result.forwards == 4
    assert fills_per_step(events) == [[3, 4, 5, 6], [7, 9], [10, 11], [8, 12]]
    assert result.generated_ids == [target(p) for p in range(3, 8)] + [X] + [target(p) for p in range(9, 13)]
    # R3: position 8's distribution really differed per row
    assert [next(s.token for s in row if s.position == 8) for row in executor.calls[2].stats] == [W, X, Y]


# -- (e) EOS stops block growth, not filling ----------------------------------------------------------


def eos_choice(sequence: Sequence[int], position: int) -> tuple[int, float] | None:
    """Block 1 [3,7): 3, 4 at 0.95; 5 predicts EOS (0.95 once 4 is filled, else 0.50); 6 at 0.40.
    Block 2 [7,11): 0.80, 0.70, 0.60, 0.50. Any later block would be 0.95."""
    if position < len(PROMPT):
        return None
    if position == 5:
        return EOS, 0.95 if filled(sequence, 4) else 0.50
    low = {6: 0.40, 7: 0.80, 8: 0.70, 9: 0.60, 10: 0.50}
    return target(position), low.get(position, 0.95)


def test_eos_stops_block_growth_but_not_filling() -> None:
    """B=4, up to 4 blocks, tau_add 0.25, tau_act 0.5, k=0.

    R1 [3, 4]. R2 [5=EOS, 7]: block 2 appended before EOS; block 1's threshold fill is EOS;
    block 2 (fully activated) falls back to 7. R3 [6, 8]: no block 3 although block 2 is at
    1/4 >= tau_add; block 1's last mask and block 2's fallback still fill. R4 [9], R5 [10].
    """
    params = DecodingParams(block_size=4, max_new_tokens=16, tau_add=0.25, tau_act=0.5, conf="prob")
    result, events = generate(synthetic_model(eos_choice), PROMPT, params)

    assert fills_per_step(events) == [[3, 4], [5, 7], [6, 8], [9], [10]]
    assert result.forwards == 5
    assert result.generated_ids == [target(3), target(4), EOS, target(6), *[target(p) for p in range(7, 11)]]
    assert result.output_ids == [target(3), target(4), EOS]
    assert result.tokens == 3
    assert result.tpf == pytest.approx(3 / 5)
    assert result.padded_tpf == pytest.approx(8 / 6)


def eos_lookahead_choice(sequence: Sequence[int], position: int) -> tuple[int, float] | None:
    """As eos_choice, but block 2 is weak (0.30 .. 0.15) so a branch without it scores higher."""
    if position < len(PROMPT):
        return None
    if position == 5:
        return EOS, 0.95 if filled(sequence, 4) else 0.50
    low = {6: 0.40, 7: 0.30, 8: 0.25, 9: 0.20, 10: 0.15}
    return target(position), low.get(position, 0.95)


def test_eos_written_by_a_lookahead_sets_that_branchs_eos_flag() -> None:
    """k=1. R1 fills 3, 4 and spawns L1 at 5 with EOS (its best remaining P, .50): L1's EOS flag
    is set, so in R2 L1 appends no block while the base does (ragged rows). L1 [6 .40] = .40
    beats the base [5 .95, 6 .40, 7-10 .30 .25 .20 .15] = .375; its anchor falls back to 6.
    Block 1 is complete and EOS is set: R3 appends nothing and stops. 2 forwards."""
    params = DecodingParams(
        block_size=4, max_new_tokens=16, tau_add=0.25, tau_act=0.5, conf="prob", branches=1
    )
    model = synthetic_model(eos_lookahead_choice)
    executor = RecordingExecutor(model)
    result, events = generate(model, PROMPT, params, executor=executor)

    assert [[len(w.tokens) for w in c.windows] for c in executor.calls] == [[7], [4, 8]]
    assert result.winners == [0, 0]
    assert fills_per_step(events) == [[3, 4], [5, 6]]
    assert result.generated_ids == [target(3), target(4), EOS, target(6)]
    assert result.output_ids == [target(3), target(4), EOS]
    assert result.forwards == 2


def test_no_block_is_appended_past_the_length_limit() -> None:
    """max_new_tokens allows 4 blocks of 4, but the decoder's length limit is prompt + 9:
    the third block (11 + 4 > 12) never fits, so generation ends after two blocks."""
    params = DecodingParams(block_size=4, max_new_tokens=16, tau_add=0.0, conf="prob")
    result, events = generate(synthetic_model(certain_choice), PROMPT, params, max_length=12)
    assert len(result.generated_ids) == 8
    assert max(len(e.tokens) for e in events) == 11
    assert MASK not in result.generated_ids


# -- (f) ties go to the earlier candidate -------------------------------------------------------------


def tie_choice(sequence: Sequence[int], position: int) -> tuple[int, float] | None:
    """3: 0.95. 4 and 5: identical distributions (token 7, 0.60). 6: 0.95 once 4 or 5 is
    filled, else 0.50."""
    if position < len(PROMPT):
        return None
    if position in (4, 5):
        return 7, 0.60
    if position == 6:
        return target(position), 0.95 if filled(sequence, 4) or filled(sequence, 5) else 0.50
    return target(position), 0.95


def test_equal_scores_go_to_the_earlier_lookahead() -> None:
    """k=2. R1 fills 3; spawns L1 at 4 and L2 at 5 (equal Conf: stable by position).
    R2: L1 [5 .60, 6 .95] and L2 [4 .60, 6 .95] score exactly the same (.775), the base
    [.60 .60 .50] less -> L1 wins; its lookahead (4) and the anchor's 6 are committed
    (L2 would have committed 5). R3: L1 at 5 has no masks (+1.0) and wins. 3 forwards."""
    params = DecodingParams(block_size=4, max_new_tokens=4, conf="prob", branches=2)
    model = synthetic_model(tie_choice)
    executor = RecordingExecutor(model)
    result, events = generate(model, PROMPT, params, executor=executor)

    scores = [
        rules.branch_score([s.conf for s in row], 1.0, params.alpha, params.beta)
        for row in executor.calls[1].stats
    ]
    assert scores[0] == scores[1] > scores[2]
    assert result.winners == [0, 0, 0]
    assert fills_per_step(events) == [[3], [4, 6], [5]]
    assert result.forwards == 3


# -- (g) stream events ---------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("eos_at", [None, 11])
def test_step_events_rebuild_the_output(k: int, eos_at: int | None) -> None:
    """One event per forward; each generated position is filled in exactly one event; the
    union of the fills is the generated sequence; the last event's tokens are the result."""
    prompt = [4, 2, 7, 1]
    params = DecodingParams(block_size=6, max_new_tokens=36, tau_add=0.3, tau_act=0.8, branches=k)
    result, events = generate(synthetic_model(hash_choice(len(prompt), eos_at=eos_at)), prompt, params)

    assert len(events) == result.forwards
    assert [e.step for e in events] == list(range(1, result.forwards + 1))
    assert [e.winner for e in events] == result.winners
    rebuilt: dict[int, int] = {}
    for event in events:
        for position, token in event.fills:
            assert position not in rebuilt and position >= len(prompt) and token != MASK
            rebuilt[position] = token
    generated = [rebuilt[p] for p in sorted(rebuilt)]
    assert sorted(rebuilt) == list(range(len(prompt), len(prompt) + len(result.generated_ids)))
    assert generated == result.generated_ids
    assert events[-1].tokens == prompt + result.generated_ids
    if eos_at is not None:
        assert result.output_ids == result.generated_ids[: eos_at + 1]
    if k:
        assert any(w != e.candidates - 1 for w, e in zip(result.winners, events, strict=True))


# -- (h) the layout worked case at the executor ---------------------------------------------------------


def layout_choice(sequence: Sequence[int], position: int) -> tuple[int, float] | None:
    """Position 21 predicts 5 + (the token at 25 if filled, else 0), P 0.6; the rest 0.6 too."""
    if position == 21:
        return 5 + (sequence[25] if filled(sequence, 25) else 0), 0.6
    return target(position), 0.6


def test_layout_worked_case_at_the_executor() -> None:
    """Prompt [0,5) and block [5,13) cached, [13,21) TO_CACHE, [21,29) ACTIVE -> window 13..28,
    u=8, S=21, cache 13 before and 21 after. Three candidates differ at 25 (lookaheads
    holding 1 and 2, base masked), so the raw output at u-1 (position 21's distribution)
    differs per row; committing row 1 stores ITS output, which the next u=0 window uses for
    position 21 even though the fresh context would predict something else."""
    tokens = [1] * 5 + [2] * 8 + [3] * 8 + [MASK] * 8
    branch = Branch(
        tokens=tokens,
        blocks=[
            Block(0, 5, BlockState.IN_CACHE, True),
            Block(5, 13, BlockState.IN_CACHE, True),
            Block(13, 21, BlockState.TO_CACHE, True),
            Block(21, 29, BlockState.ACTIVE, True),
        ],
    )
    assert (
        rules.window_start(branch),
        rules.to_cache_length(branch),
        rules.completed_prefix_end(branch),
    ) == (
        13,
        8,
        21,
    )
    model = synthetic_model(layout_choice)
    executor = LocalExecutor(model)
    generation = Decoder(executor, MASK, [EOS], MAX_LENGTH).start(tokens[:5], DecodingParams())
    executor.begin(DecodingParams(), 3)
    # pre-fill the cache with [0, 13) through the protocol itself
    prefill = BranchWindow(tokens[:13], [0] * 5 + [1] * 8, [])
    assert verify_part(executor, VerifyPart(0, 0, 13, [prefill])) == [[]]
    executor.commit_many([(0, 0)])
    assert model.cache_length() == 13

    window = generation._window(branch, 13)
    assert window.tokens == tokens[13:]
    assert window.block_ids == [2] * 8 + [3] * 8
    assert window.masked == list(range(21, 29))
    rows = []
    for lookahead_token in (1, 2, None):
        row = branch.copy()
        if lookahead_token is not None:
            row.tokens[25] = lookahead_token
        rows.append(generation._window(row, 13))
    stats = verify_part(executor, VerifyPart(0, 13, 8, rows))
    assert model.cache_length() == 13  # staged, not yet committed
    assert [row[0].position for row in stats] == [21, 21, 21]
    assert [row[0].token for row in stats] == [6, 7, 5]
    executor.commit_many([(0, 1)])
    assert model.cache_length() == 21
    assert model.cache == tokens[:21]

    # next round: u = 0, the window starts at 21 (masked): the stored logit is row 1's raw output
    fresh = [MASK, 3, 3, 3, 9, 3, 3, 3]  # a fresh forward would now predict 5 + 9
    (row,) = verify_part(executor, VerifyPart(0, 21, 0, [BranchWindow(fresh, [3] * 8, [21])]))
    assert row[0].token == 7
