"""`lopa bench weights`: FP8 weights against the model dtype's, on one model in one run.

Two measures: the logits of one forward over held-out prompts (relative error ||fp8 - dtype|| /
||dtype|| and how often their argmax agrees), and greedy decoding of the held-out split at each k
with either weights: exact match of each, TPF of each, and greedy agreement (the share of prompts
whose generated tokens are identical).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lopa.bundled.tasks import Example, score
from lopa.engine import LocalEngine
from lopa.model.transformer import DiffusionLM
from lopa.params import DecodingParams


@dataclass(frozen=True)
class Decoded:
    outputs: list[list[int]]  # each prompt's generated ids
    hits: list[bool]  # exact match of each
    tokens: int
    forwards: int

    @property
    def exact_match(self) -> float:
        return sum(self.hits) / len(self.hits) if self.hits else 0.0

    @property
    def tpf(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0


def decode_all(engine: LocalEngine, examples: Sequence[Example], params: DecodingParams) -> Decoded:
    outputs, hits, tokens, forwards = [], [], 0, 0
    for example in examples:
        completion = engine.generate(example.prompt, params)
        outputs.append(list(completion.result.generated_ids))
        hits.append(score(example, completion.text))
        tokens += completion.result.tokens
        forwards += completion.result.forwards
    return Decoded(outputs, hits, tokens, forwards)


def agreement(first: Decoded, second: Decoded) -> float:
    """The share of prompts decoded to identical tokens."""
    same = sum(a == b for a, b in zip(first.outputs, second.outputs, strict=True))
    return same / len(first.outputs) if first.outputs else 0.0


def decode_row(k: int, dtype: Decoded, fp8: Decoded) -> dict:
    return {
        "kind": "decode", "k": k, "prompts": len(dtype.hits),
        "dtype_exact_match": round(dtype.exact_match, 4), "fp8_exact_match": round(fp8.exact_match, 4),
        "exact_match_points": round(100 * (fp8.exact_match - dtype.exact_match), 2),
        "dtype_tpf": round(dtype.tpf, 3), "fp8_tpf": round(fp8.tpf, 3),
        "greedy_agreement": round(agreement(dtype, fp8), 4),
    }


@torch.no_grad()
def logits_row(
    dtype: DiffusionLM, fp8: DiffusionLM, prompts: Sequence[Sequence[int]], length: int = 64
) -> dict:
    """One forward of each prompt's first `length` tokens (shorter ones padded with their last
    token) through both models: the relative error of the logits and their argmax agreement."""
    rows = [list(p[:length]) + [p[-1]] * (length - len(p[:length])) for p in prompts if p]
    tokens = torch.tensor(rows, dtype=torch.long, device=dtype.device)
    positions = torch.arange(tokens.shape[1], device=dtype.device)
    want = dtype(tokens, positions).double()
    got = fp8(tokens, positions).double()
    return {
        "kind": "logits", "sequences": len(rows), "tokens": tokens.numel(),
        "relative_error": round(float((got - want).norm() / want.norm()), 5),
        "argmax_agreement": round(float((got.argmax(-1) == want.argmax(-1)).double().mean()), 4),
    }
