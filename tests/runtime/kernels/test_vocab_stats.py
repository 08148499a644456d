"""The lm_head + greedy statistics kernel equals the reference: the token, P and Conf (prob,
neg_entropy, margin) of each row, for lm_head weights in the model dtype and FP8.

Tolerances: fp32, P and Conf within 1e-5 (neg_entropy: plus vocab x 1e-10, the reference's
epsilon inside the log) and the same token; bf16 (the logits rounded to bf16 before the
statistics, toward zero in the interpreter), P and Conf within 0.05 + 5% and the same token wherever
the reference's top two logits are more than two bf16 units apart."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import HIDDEN, ROWS, VOCAB

from lopa.execution.sampling import position_stats
from lopa.kernels import fp8, vocab_stats
from lopa.params import ConfKind, DecodingParams


def _case(rows: int, dtype: torch.dtype, quantized: bool, seed: int):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, HIDDEN, generator=generator).to(dtype)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator) / HIDDEN**0.5 * 3
    weight[seed % VOCAB] *= 2  # one likely token: peaked and flat rows both occur
    if quantized:
        values, scale = fp8.quantize(weight)
        return hidden, values, scale
    return hidden, weight.to(dtype), None


def test_the_reference_is_what_the_executor_computes() -> None:
    hidden, weight, _ = _case(9, torch.float32, False, seed=1)
    logits = hidden @ weight.t()
    for kind in ConfKind:
        want = position_stats(logits, DecodingParams(conf=kind))
        got = vocab_stats.greedy_stats_reference(hidden, weight, None, kind)
        for one, other in zip(got, want, strict=True):
            assert torch.equal(one, other)


def _statistics(rows: int, dtype: torch.dtype, quantized: bool) -> None:
    """Every Conf kind from one pass (the first kernel is the same for all)."""
    hidden, weight, scale = _case(rows, dtype, quantized, seed=rows)
    found = vocab_stats.partials(hidden, weight, scale)
    for kind in ConfKind:
        tokens, probs, confs = vocab_stats.merge(found, kind)
        want_tokens, want_probs, want_confs = vocab_stats.greedy_stats_reference(hidden, weight, scale, kind)
        assert tokens.dtype == torch.long and probs.dtype == confs.dtype == torch.float32
        if dtype == torch.float32:
            assert torch.equal(tokens, want_tokens), kind
            torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(confs, want_confs, rtol=1e-5, atol=1e-5 + VOCAB * 1e-10)
            continue
        product = fp8.linear_reference(hidden, weight, scale) if scale is not None else hidden @ weight.t()
        top2 = product.float().topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * 2**-7 * top2[:, 0].abs()
        assert torch.equal(tokens[clear], want_tokens[clear]), kind
        torch.testing.assert_close(probs, want_probs, rtol=0.05, atol=0.05)
        torch.testing.assert_close(confs, want_confs, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("rows", ROWS)
def test_one_pass_statistics_equal_the_reference(rows: int) -> None:
    _statistics(rows, torch.float32, False)


CASES = [(torch.float32, True), (torch.bfloat16, False), (torch.bfloat16, True)]


@pytest.mark.parametrize("dtype,quantized", CASES)
def test_one_pass_statistics_of_bf16_and_fp8_heads(dtype: torch.dtype, quantized: bool) -> None:
    for rows in (1, 17):
        _statistics(rows, dtype, quantized)


def test_the_vocabulary_split_into_chunks_gives_the_same_statistics() -> None:
    hidden, weight, _ = _case(5, torch.float32, False, seed=3)
    whole = vocab_stats.greedy_stats(hidden, weight, None, ConfKind.MARGIN, parts=1)
    chunked = vocab_stats.greedy_stats(hidden, weight, None, ConfKind.MARGIN, block_v=64, parts=7)
    assert torch.equal(whole[0], chunked[0])
    torch.testing.assert_close(whole[1], chunked[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(whole[2], chunked[2], rtol=1e-6, atol=1e-6)
