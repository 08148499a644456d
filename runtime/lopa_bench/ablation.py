"""`lopa bench ablation`: the value of choosing the order, apart from verifying more rows.

Every round verifies the same k lookaheads and the anchor in one forward, as LoPA does; only the
winner differs: LoPA's confidence score (docs/decoding.md section 4 step 5), a uniformly random
candidate, or always the anchor. The anchor always winning decodes exactly as D2F while paying
for k + 1 rows; a random winner takes lookahead tokens without judging them.

The winner is steered from outside the rules: the chosen row's Conf values are all raised by the
same constant, which makes its score the highest and leaves every decision inside the row (its
fallback fill, the ranking of the next lookaheads) as it was.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from typing import TextIO

from lopa.bundled.tasks import Example
from lopa.decoding.executor import BranchWindow, Executor
from lopa.params import DecodingParams
from lopa_bench.single import ExecutorProxy, SingleModel, Stats, Tally

CHOICES = ("confidence", "random", "anchor")
LIFT = 1.0e4  # far above any Conf spread (neg_entropy >= -ln(vocab), prob and margin <= 1)


class ForcedWinner(ExecutorProxy):
    """Makes one chosen candidate of each round win: the anchor (last) or a seeded random one."""

    def __init__(self, inner: Executor, choice: str, seed: int) -> None:
        super().__init__(inner)
        self.choice = choice
        self.rng = random.Random(seed)

    def verify(self, start: int, n_stage: int, windows: Sequence[BranchWindow]) -> Stats:
        rows = super().verify(start, n_stage, windows)
        chosen = len(rows) - 1 if self.choice == "anchor" else self.rng.randrange(len(rows))
        rows[chosen] = [replace(s, conf=s.conf + LIFT) for s in rows[chosen]]
        return rows


def run_ablation(
    model: SingleModel,
    examples: Sequence[Example],
    base: DecodingParams,
    ks: Sequence[int],
    choices: Sequence[str] = CHOICES,
    seed: int = 0,
    log: TextIO | None = None,
) -> list[dict]:
    """One row per (k, winner choice): exact match, TPF, forwards, verified tokens per token."""
    log = log or sys.stderr
    rows = []
    for k in ks:
        params = base.with_overrides(branches=k)
        for choice in choices:
            tally = Tally()
            for index, example in enumerate(examples):
                forced = partial(ForcedWinner, choice=choice, seed=seed + index)
                proxy = None if choice == "confidence" else forced
                result = model.generate(model.encode(example.prompt), params, proxy)
                tally.add(example, model.decode(result.output_ids), result)
            rows.append({"attention": params.attention.value, "k": k, "winner": choice, **tally.row()})
            print(f"k={k} {choice:>10}: TPF {tally.tpf:.2f}", file=log, flush=True)
    return rows


def plot(rows: Sequence[dict], path: str) -> None:
    """TPF (left) and exact match (right) against k, one line per winner choice."""
    from lopa_bench.figures import figure

    with figure(path, columns=2) as (tpf_axis, em_axis):
        for choice in dict.fromkeys(r["winner"] for r in rows):
            mine = [r for r in rows if r["winner"] == choice]
            ks = [r["k"] for r in mine]
            tpf_axis.plot(ks, [r["tpf"] for r in mine], "o-", label=choice)
            em_axis.plot(ks, [r["exact_match_pct"] for r in mine], "s--", label=choice)
        tpf_axis.set(xlabel="lookahead branches k verified per round", ylabel="tokens per forward",
                     title="winner chosen by ...")
        em_axis.set(xlabel="lookahead branches k verified per round", ylabel="exact match (%)", ylim=(0, 105))
        tpf_axis.set_ylim(bottom=0)
        for axis in (tpf_axis, em_axis):
            axis.set_xticks(sorted({r["k"] for r in rows}))
        tpf_axis.legend(fontsize=8)
