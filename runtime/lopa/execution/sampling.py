"""Reduce a position's logits to (x_hat, P, Conf): the only thing the decoder ever sees."""

from __future__ import annotations

import math

import torch

from lopa.params import ConfKind, DecodingParams

ENTROPY_EPS = 1e-10


def distributions(logits: torch.Tensor, params: DecodingParams) -> torch.Tensor:
    """[N, V] logits -> [N, V] fp32 probabilities after temperature, top-p, top-k and min-p."""
    logits = logits.float()
    if params.temperature > 0:
        # Every finite temperature is safe: the row maximum is subtracted first (the others go to
        # -inf at worst, the maximum stays 0, softmax is unchanged), and the divisor is kept a
        # normal fp32 number (a smaller one would round to 0 and give 0/0 = NaN; any positive
        # temperature that small already sends every non-maximal logit to -inf).
        temperature = max(params.temperature, torch.finfo(logits.dtype).tiny)
        logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    # top-p, then top-k: docs/decoding.md (rule 5) and Dream's sample_tokens (top-p's mass is the full
    # distribution's; the other order would take it over the k kept tokens only).
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token once the mass before it already exceeds top_p (the best token always stays).
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) > params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.min_p > 0:
        # vLLM's min-p: a token stays when its probability is at least min_p times the top one's,
        # that is when its logit is at least the top logit + log(min_p) (the top token always stays).
        floor = logits.amax(dim=-1, keepdim=True) + math.log(params.min_p)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    return torch.softmax(logits, dim=-1)


def confidence(probs: torch.Tensor, chosen_prob: torch.Tensor, kind: ConfKind) -> torch.Tensor:
    """Conf of each row: prob, neg_entropy (<= 0, higher = more confident) or top1 - top2 margin."""
    if kind is ConfKind.PROB:
        return chosen_prob
    if kind is ConfKind.NEG_ENTROPY:
        return (probs * torch.log(probs + ENTROPY_EPS)).sum(dim=-1)
    top2 = torch.topk(probs, 2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


def position_stats(
    logits: torch.Tensor, params: DecodingParams, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, V] logits -> (x_hat [N] int64, P [N] fp32, Conf [N] fp32)."""
    probs = distributions(logits, params)
    if params.greedy:
        chosen_prob, tokens = probs.max(dim=-1)
    else:
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        chosen_prob = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, chosen_prob, confidence(probs, chosen_prob, params.conf)
