"""k = 0 is exactly D2F: the Decoder against an independent reference of docs/decoding.md section 3.

`reference_d2f` below is written from the consts only (its own block list, its own loop,
its own logit shift, stored last logit, softmax and Conf) and calls the WindowModel
directly, one row per forward. The Decoder (branches=0, LocalExecutor) must produce the
same tokens with the same number of forwards on synthetic models and on small random
real checkpoints of both families (Dream's shifted logits, LLaDA's own-position logits),
in both attention modes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
from synthetic_cases import (
    EOS,
    MASK,
    MAX_LENGTH,
    generate,
    hash_choice,
    synthetic_model,
)

from lopa.decoding.decoder import Decoder
from lopa.execution.local import LocalExecutor
from lopa.model.protocol import WindowBatch, WindowModel
from lopa.params import AttentionMode, ConfKind, DecodingParams
from lopa.scheduling.budget import Budget
from lopa.scheduling.request import Request, Waiter
from lopa.scheduling.scheduler import Scheduler

TOP = 3  # alternatives asked per answer token

# -- the reference ----------------------------------------------------------------------------------


@dataclass
class RefBlock:
    start: int
    end: int
    state: str  # "active" | "to_cache" | "in_cache"
    full: bool  # fully activated (sticky)


@dataclass
class RefResult:
    generated: list[int]
    forwards: int
    semi_activated_fill_rounds: int  # rounds in which a semi-activated block had masks
    eos_round: int | None  # the round in which EOS was first filled
    max_blocks_seen: int
    fill_probs: dict[int, float]  # each filled position's P in the round that filled it
    fill_tops: dict[int, list[tuple[int, float]]]  # its TOP most probable tokens then, with their logprob


def ref_conf(probs: torch.Tensor, kind: ConfKind) -> float:
    top = torch.topk(probs, 2).values
    if kind is ConfKind.PROB:
        return float(top[0])
    if kind is ConfKind.MARGIN:
        return float(top[0] - top[1])
    return float((probs * torch.log(probs + 1e-10)).sum())


def reference_d2f(
    model: WindowModel,
    prompt: Sequence[int],
    params: DecodingParams,
    mask_id: int,
    eos_ids: Sequence[int],
    max_length: int,
) -> RefResult:
    """docs/decoding.md section 3, literally, greedy only; a masked position's logits are the
    output `shift` positions before it (the model's logit_shift: 1 for Dream, 0 for LLaDA)."""
    shift = getattr(model, "logit_shift", 1)
    B = params.block_size
    seq = list(prompt)
    blocks = [RefBlock(0, len(prompt), "to_cache", True)]
    model.reset(1)
    stored: torch.Tensor | None = None
    eos = False
    forwards = semi_rounds = 0
    eos_round: int | None = None
    fill_probs: dict[int, float] = {}
    fill_tops: dict[int, list[tuple[int, float]]] = {}
    tops: dict[int, list[tuple[int, float]]] = {}

    def decoded(b: RefBlock) -> float:
        return sum(1 for t in seq[b.start : b.end] if t != mask_id) / (b.end - b.start)

    while True:
        # 1. add a block
        if (
            len(blocks) - 1 < params.max_new_tokens // B
            and not eos
            and len(seq) + B <= max_length
            and decoded(blocks[-1]) >= params.tau_add
        ):
            blocks.append(RefBlock(len(seq), len(seq) + B, "active", False))
            seq += [mask_id] * B
        # 2. activation, from the counts at the end of the previous round
        fractions = [decoded(b) for b in blocks]
        for j in range(len(blocks) - 1):
            if fractions[j] >= params.tau_act:
                blocks[j + 1].full = True
        # 3. stop
        if mask_id not in seq and all(b.state != "active" for b in blocks):
            break
        # 4. forward the window
        to_cache = [b for b in blocks if b.state == "to_cache"]
        start = to_cache[0].start if to_cache else next(b.start for b in blocks if b.state == "active")
        u = sum(b.end - b.start for b in to_cache)
        assert model.cache_length() == start
        ids = [next(i for i, b in enumerate(blocks) if b.start <= p < b.end) for p in range(start, len(seq))]
        raw = model.forward(
            WindowBatch(
                tokens=torch.tensor([seq[start:]]),
                lengths=[len(seq) - start],
                block_ids=torch.tensor([ids]),
                start=start,
                n_stage=u,
                mode=params.attention,
            )
        )[0].float()
        forwards += 1
        new_stored = stored
        if u > 0:
            model.commit(0, u)
            new_stored = raw[u - 1].clone() if shift else None
        # 5. fills, block by block, from this forward's distributions
        round_eos = False
        for b in blocks:
            if b.state != "active":
                continue
            masked = [p for p in range(b.start, b.end) if seq[p] == mask_id]
            if not masked:
                continue
            if not b.full:
                semi_rounds += 1
            cands = []  # (position, token, P, Conf)
            for p in masked:
                if p - start - shift >= 0:
                    logits = raw[p - start - shift]
                elif stored is not None:
                    logits = stored
                else:
                    logits = torch.zeros(raw.shape[-1])
                probs = torch.softmax(logits.float(), dim=-1)
                token = int(torch.argmax(probs))
                cands.append((p, token, float(probs[token]), ref_conf(probs, params.conf)))
                top = torch.topk(probs, TOP)
                tops[p] = [(int(t), math.log(float(v))) for t, v in zip(top.indices, top.values, strict=True)]
            fills = [c for c in cands if c[2] > params.tau_conf]
            if not fills and b.full:
                best = cands[0]
                for c in cands[1:]:
                    if c[3] > best[3]:
                        best = c
                fills = [best]
            for p, token, prob, _ in fills:
                seq[p] = token
                fill_probs[p] = prob
                fill_tops[p] = tops[p]
                if token in eos_ids:
                    round_eos = True
        if round_eos and not eos:
            eos, eos_round = True, forwards
        stored = new_stored
        # 6. bookkeeping
        for b in blocks:
            if b.state == "to_cache":
                b.state = "in_cache"
        for b in blocks:
            if b.state == "active":
                if mask_id in seq[b.start : b.end]:
                    break
                b.state = "to_cache"
    generated = seq[len(prompt) :]
    return RefResult(generated, forwards, semi_rounds, eos_round, len(blocks) - 1, fill_probs, fill_tops)


# -- synthetic models -------------------------------------------------------------------------------

PROMPT = [3, 1, 4, 1, 5]

SYNTHETIC_CASES = {
    # name: (eos_at, DecodingParams)
    "defaults_b8": (None, DecodingParams(block_size=8, max_new_tokens=32, tau_conf=0.9)),
    "eos": (13, DecodingParams(block_size=8, max_new_tokens=48, tau_add=0.25, tau_act=0.75)),
    "semi_activated": (None, DecodingParams(block_size=8, max_new_tokens=40, tau_add=0.1, tau_act=1.0)),
    "prob_conf_low_tau": (
        None,
        DecodingParams(block_size=4, max_new_tokens=24, tau_add=0.5, tau_act=0.5, tau_conf=0.8, conf="prob"),
    ),
    "margin_block_causal": (
        5,
        DecodingParams(
            block_size=6, max_new_tokens=36, tau_add=0.3, tau_act=0.9, conf="margin", attention="block_causal"
        ),
    ),
    "tau_add_zero": (None, DecodingParams(block_size=4, max_new_tokens=16, tau_add=0.0, tau_act=0.95)),
}


@pytest.mark.parametrize("shift", [1, 0], ids=["shifted", "own_position"])
@pytest.mark.parametrize("attention", [AttentionMode.FULL, AttentionMode.BLOCK_CAUSAL])
@pytest.mark.parametrize("case", sorted(SYNTHETIC_CASES))
def test_k0_matches_reference_on_synthetic_models(case: str, attention: AttentionMode, shift: int) -> None:
    eos_at, params = SYNTHETIC_CASES[case]
    params = params.with_overrides(attention=attention)
    choice = hash_choice(len(PROMPT), eos_at=eos_at)

    ref = reference_d2f(synthetic_model(choice, logit_shift=shift), PROMPT, params, MASK, [EOS], MAX_LENGTH)
    model = synthetic_model(choice, logit_shift=shift)
    result, _ = generate(model, PROMPT, params)

    assert result.generated_ids == ref.generated
    assert result.forwards == ref.forwards == model.forward_calls
    assert result.winners == [0] * ref.forwards
    assert MASK not in result.generated_ids
    # the scenario covers what its name says
    if eos_at is not None:
        assert ref.eos_round is not None
        assert result.output_ids[-1] == EOS and EOS not in result.output_ids[:-1]
        assert len(result.output_ids) == result.generated_ids.index(EOS) + 1
    else:
        assert EOS not in result.generated_ids
        assert ref.max_blocks_seen == params.max_new_tokens // params.block_size
    if case == "semi_activated":
        assert ref.semi_activated_fill_rounds > 0


def test_the_hash_model_really_depends_on_order() -> None:
    """Sanity check of the fixture: with k = 0 the tokens differ from a different fill order
    (tau_conf changes which positions fill together), so the comparison above is not vacuous."""
    choice = hash_choice(len(PROMPT))
    a = reference_d2f(
        synthetic_model(choice),
        PROMPT,
        DecodingParams(block_size=8, max_new_tokens=32),
        MASK,
        [EOS],
        MAX_LENGTH,
    )
    b = reference_d2f(
        synthetic_model(choice),
        PROMPT,
        DecodingParams(block_size=8, max_new_tokens=32, tau_conf=0.5),
        MASK,
        [EOS],
        MAX_LENGTH,
    )
    assert a.generated != b.generated
    assert a.forwards > b.forwards


# -- a small random real checkpoint ----------------------------------------------------------------


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("attention", [AttentionMode.FULL, AttentionMode.BLOCK_CAUSAL])
@pytest.mark.parametrize(
    "params",
    [
        DecodingParams(block_size=8, max_new_tokens=24, tau_add=0.25, tau_act=0.75, tau_conf=0.9),
        DecodingParams(block_size=4, max_new_tokens=16, tau_add=0.5, tau_act=0.5, tau_conf=0.6, conf="prob"),
    ],
    ids=["neg_entropy_b8", "prob_b4"],
)
def test_k0_matches_reference_on_a_random_checkpoint(
    request: pytest.FixtureRequest, params: DecodingParams, attention: AttentionMode, family: str
) -> None:
    loader = pytest.importorskip("lopa.model.loader")
    checkpoint = request.getfixturevalue("tiny_checkpoint" if family == "dream" else "tiny_llada_checkpoint")
    loaded = loader.load_model(checkpoint, dtype="float32")
    assert loaded.config.logit_shift == (1 if family == "dream" else 0)
    # Sharpen the random head (it is near-uniform) so that some P exceed tau_conf: rounds then mix
    # threshold fills, fallbacks and semi-activated blocks.
    loaded.model.lm_head.weight.mul_(16.0)
    params = params.with_overrides(attention=attention)
    mask, eos = loaded.mask_token_id, list(loaded.eos_token_ids)
    prompt = [5, 17, 42, 8, 23, 61]

    ref = reference_d2f(loaded.window_model(64), prompt, params, mask, eos, 64)
    result, _ = generate(loaded.window_model(64), prompt, params, mask_id=mask, eos_ids=eos, max_length=64)

    assert result.generated_ids == ref.generated
    assert result.forwards == ref.forwards
    assert mask not in result.generated_ids
    assert ref.forwards < len(ref.generated)  # some rounds filled several positions
    # Each answer token's logprob is its P in the round that filled it (docs/decoding.md section 6).
    expected = [math.log(ref.fill_probs[len(prompt) + i]) for i in range(len(result.output_ids))]
    assert result.output_logprobs == pytest.approx(expected, rel=1e-6, abs=1e-9)
    # Asked for, each answer token's TOP most probable tokens in that round come with it; the same
    # request otherwise decodes the same (the scheduler runs it: the product's loop).
    executor = LocalExecutor(loaded.window_model(64))
    decoder = Decoder(executor, mask, eos, 64)
    scheduler = Scheduler(decoder, executor, str, 1, Budget(tokens=100_000))
    waiter = Waiter()
    scheduler.submit(Request(prompt, params, on_done=waiter, top_logprobs=TOP))
    scheduler.start()
    try:
        served = waiter.wait().result
    finally:
        scheduler.stop()
    assert served.output_ids == result.output_ids and served.output_logprobs == result.output_logprobs
    for i, alternatives in enumerate(served.output_alternatives):
        want = ref.fill_tops[len(prompt) + i]
        assert [t for t, _ in alternatives] == [t for t, _ in want]
        assert [lp for _, lp in alternatives] == pytest.approx([lp for _, lp in want], rel=1e-5, abs=1e-6)
        assert alternatives[0][0] == served.output_ids[i]  # greedy: the argmax, at its own logprob
        assert alternatives[0][1] == pytest.approx(served.output_logprobs[i], rel=1e-5, abs=1e-6)
