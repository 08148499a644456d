"""Sampling is numerically safe over the whole accepted range of every knob.

A temperature as small as 1e-40 or 1e-300 must not overflow logits / temperature in fp32: NaN
probabilities would make torch.multinomial raise, and a served request take its worker group down.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from lopa.execution.sampling import distributions, position_stats
from lopa.params import DecodingParams, InvalidParameter

TINY = 5e-324  # the smallest positive double
HUGE = 1.7976931348623157e308  # the largest finite double
VOCAB = 64


def logits() -> torch.Tensor:
    out = 6 * torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0))
    out[1, 7] = out[1].max()  # an exact tie for the maximum
    out[2] = 0.0  # a flat row
    return out


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"),
    list(itertools.product([TINY, 1e-300, 1e-40, 1e-6, 1.0, 1e300, HUGE], [TINY, 1e-300, 0.5, 1.0],
                           [0, 1, VOCAB - 1, VOCAB, VOCAB + 1, 2**31 - 1])),
)
def test_every_valid_setting_gives_finite_statistics(temperature: float, top_p: float, top_k: int) -> None:
    for conf in ("prob", "neg_entropy", "margin"):
        params = DecodingParams(temperature=temperature, top_p=top_p, top_k=top_k, conf=conf, seed=2**64 - 1)
        tokens, probs, confs = position_stats(logits(), params, torch.Generator().manual_seed(params.seed))
        assert torch.isfinite(probs).all() and torch.isfinite(confs).all()
        assert ((tokens >= 0) & (tokens < VOCAB)).all()
        assert ((probs > 0) & (probs <= 1)).all()


def test_a_vanishing_temperature_samples_the_greedy_token() -> None:
    rows = logits()[[0, 3, 4]]  # no ties
    greedy, _, _ = position_stats(rows, DecodingParams())
    for temperature in (TINY, 1e-300, 1e-40):
        sampled, probs, _ = position_stats(rows, DecodingParams(temperature=temperature), torch.Generator())
        assert torch.equal(sampled, greedy) and torch.equal(probs, torch.ones(3))


def test_a_huge_temperature_is_uniform() -> None:
    _, probs, _ = position_stats(logits(), DecodingParams(temperature=HUGE), torch.Generator())
    torch.testing.assert_close(probs, torch.full((5,), 1 / VOCAB))


@pytest.mark.parametrize("temperature", [math.inf, -math.inf, math.nan, -1e-300])
def test_a_temperature_that_cannot_be_made_safe_is_refused(temperature: float) -> None:
    with pytest.raises(InvalidParameter, match="temperature: must be a finite number >= 0"):
        DecodingParams(temperature=temperature)


def test_top_p_takes_the_full_distributions_mass_before_top_k() -> None:
    """algorithm.md (and Dream's sample_tokens): temperature, then top-p, then top-k. With P =
    [0.4, 0.3, 0.2, 0.1], top_p 0.5 keeps {0.4, 0.3} and top_k 2 keeps both: P = 0.571, below
    tau_conf 0.9. The other order (top-k first, top-p over the renormalised pair) kept one token
    and gave P = 1.0: a position filled that the spec leaves masked."""
    from lopa.execution.sampling import distributions

    row = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    probs = distributions(row, DecodingParams(top_p=0.5, top_k=2))
    assert torch.allclose(probs, torch.tensor([[4 / 7, 3 / 7, 0.0, 0.0]]))
    _, chosen, _ = position_stats(row, DecodingParams(top_p=0.5, top_k=2))
    assert chosen.item() == pytest.approx(4 / 7)


def test_a_request_without_a_seed_samples_anew_and_one_with_a_seed_repeats(bundled_engine) -> None:
    """OpenAI's and vLLM's sampling: no seed, a fresh draw per request; a seed, the same answer."""
    from lopa.bundled import tasks

    prompt = tasks.held_out(1)[0].prompt
    hot = DecodingParams(block_size=8, max_new_tokens=32, temperature=1.5)
    fresh = [bundled_engine.generate(prompt, hot).result.generated_ids for _ in range(4)]
    assert len({tuple(ids) for ids in fresh}) > 1
    seeded = hot.with_overrides(seed=7)
    again = [bundled_engine.generate(prompt, seeded).result.generated_ids for _ in range(3)]
    assert again[0] == again[1] == again[2]
    assert DecodingParams().seed is None and DecodingParams().seeded().seed is not None
    assert seeded.seeded() is seeded


def test_min_p_keeps_the_tokens_within_its_factor_of_the_top_one() -> None:
    """vLLM's min-p: tokens of P >= min_p x P(top) stay (renormalised), the rest are dropped."""
    probs = torch.tensor([[0.5, 0.3, 0.12, 0.08]])
    kept = distributions(probs.log(), DecodingParams(temperature=1.0, min_p=0.2))  # floor 0.1
    expected = torch.tensor([[0.5, 0.3, 0.12, 0.0]]) / 0.92
    torch.testing.assert_close(kept, expected)
    assert torch.equal(distributions(probs.log(), DecodingParams(temperature=1.0, min_p=1.0)),
                       torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    with pytest.raises(InvalidParameter, match="min_p"):
        DecodingParams(min_p=1.5)
