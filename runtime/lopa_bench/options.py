"""`lopa bench options`: the paper's open questions as decoding settings, measured against its rules.

Two sweeps on the held-out prompts, greedy, one request at a time:
  - the branch score: `branch_score: mean` at beta 1 (the paper's Eq. 2, the default), the mean of
    the least confident half (beta 0.5) and the minimum (beta 0.001: one value), then
    `branch_score: block_min` (the least confident block's mean) and `fills` (the tokens the round
    would commit), for each k;
  - the branch count: `branch_policy: fixed` (k every round) against `auto` (k is the ceiling:
    all k after a stalled round, fewer after a round whose anchor filled much), for each k.
Each row: exact match, TPF, forwards, lookaheads verified per round and verified tokens per token
(what the rows cost).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TextIO

from lopa.bundled.tasks import Example
from lopa.params import DecodingParams
from lopa_bench.single import SingleModel, Tally

# (label, overrides): the score variants, the default first
SCORES: tuple[tuple[str, dict], ...] = (
    ("mean (paper)", {}),
    ("mean, beta 0.5", {"beta": 0.5}),
    ("min (beta 0.001)", {"beta": 0.001}),
    ("block_min", {"branch_score": "block_min"}),
    ("fills", {"branch_score": "fills"}),
)
POLICIES: tuple[tuple[str, dict], ...] = (("fixed (paper)", {}), ("auto", {"branch_policy": "auto"}))


def sweep(
    model: SingleModel,
    examples: Sequence[Example],
    base: DecodingParams,
    ks: Sequence[int],
    variants: Sequence[tuple[str, dict]],
    kind: str,
    log: TextIO | None = None,
) -> list[dict]:
    """One row per (variant, k)."""
    log = log or sys.stderr
    rows = []
    for label, overrides in variants:
        for k in ks:
            params = base.with_overrides(branches=k, **overrides)
            tally, rounds, lookaheads = Tally(), 0, 0
            for example in examples:
                result = model.generate(model.encode(example.prompt), params)
                tally.add(example, model.decode(result.output_ids), result)
                rounds += len(result.granted_branches)
                lookaheads += sum(result.granted_branches)
            row = {kind: label, "k": k, **tally.row(),
                   "lookaheads_per_round": round(lookaheads / rounds, 2) if rounds else 0.0}
            rows.append(row)
            print(f"{label:>18} k={k}: TPF {tally.tpf:.2f}", file=log, flush=True)
    return rows


def plot(scores: Sequence[dict], policies: Sequence[dict], path: str) -> None:
    """Left: TPF against k per branch score. Right: TPF (solid) and verified tokens per token
    (dashed, right axis) against k, fixed and auto."""
    from lopa_bench.figures import figure

    with figure(path, columns=2) as (left, right):
        for label in dict.fromkeys(r["score"] for r in scores):
            mine = [r for r in scores if r["score"] == label]
            left.plot([r["k"] for r in mine], [r["tpf"] for r in mine], "o-", label=label)
        left.set(xlabel="lookahead branches k", ylabel="tokens per forward", title="branch score",
                 ylim=(0, None))
        left.legend(fontsize=7)
        cost = right.twinx()
        for colour, label in zip(("tab:blue", "tab:orange"), dict.fromkeys(r["policy"] for r in policies),
                                 strict=False):
            mine = [r for r in policies if r["policy"] == label]
            ks = [r["k"] for r in mine]
            right.plot(ks, [r["tpf"] for r in mine], "o-", color=colour, label=f"TPF, {label}")
            cost.plot(ks, [r["verified_per_token"] for r in mine], "s--", color=colour, alpha=0.6,
                      label=f"verified/token, {label}")
        right.set(xlabel="lookahead branches k (auto: the ceiling)", ylabel="tokens per forward",
                  title="branch count", ylim=(0, None))
        cost.set(ylabel="verified tokens per generated token", ylim=(0, None))
        handles = right.get_legend_handles_labels()[0] + cost.get_legend_handles_labels()[0]
        labels = right.get_legend_handles_labels()[1] + cost.get_legend_handles_labels()[1]
        right.legend(handles, labels, fontsize=7, loc="lower right")
