"""`lopa bench orders`: how much the token-filling order alone moves TPF, prompt by prompt.

A filling order is a priority over the generated positions. Decoding with an order follows D2F
(k = 0) in every rule but one: when a fully activated block has nothing above tau_conf, its
one-token fallback fills the masked position that comes first in the order, not the most
confident one (docs/decoding.md section 3 step 5). Per prompt the check decodes:
  - `orders` random orders (seeded), as a distribution; its best and worst are marked;
  - D2F's own order (the most confident position first): D2F itself;
  - LoPA's order: the positions in the order a LoPA decode with k branches committed them (each
    round's winning lookahead first), replayed with the one-token fallback;
  - LoPA itself (its TPF: its order plus the parallel verification that found it).

The fallback is steered from outside the rules: each position's Conf is replaced by minus its
rank in the order, so the fallback's "highest Conf" is the order's first masked position (with
k = 0 Conf decides nothing else).
"""

from __future__ import annotations

import random
import statistics
import sys
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from typing import TextIO

from lopa.bundled.tasks import Example, score
from lopa.decoding.executor import BranchWindow, Executor
from lopa.params import DecodingParams
from lopa_bench.single import ExecutorProxy, SingleModel, Stats


class Ordered(ExecutorProxy):
    """D2F's fallback follows `rank` (position -> priority, lower first) instead of Conf."""

    def __init__(self, inner: Executor, rank: dict[int, int]) -> None:
        super().__init__(inner)
        self.rank = rank

    def verify(self, start: int, n_stage: int, windows: Sequence[BranchWindow]) -> Stats:
        rows = super().verify(start, n_stage, windows)
        return [[replace(s, conf=-float(self.rank[s.position])) for s in row] for row in rows]


class CommitRecorder(ExecutorProxy):
    """Records each round's winning lookahead position (None when the anchor won)."""

    def __init__(self, inner: Executor) -> None:
        super().__init__(inner)
        self.windows: Sequence[BranchWindow] = ()
        self.lookaheads: list[int | None] = []

    def verify(self, start: int, n_stage: int, windows: Sequence[BranchWindow]) -> Stats:
        self.windows, self.start = windows, start
        return super().verify(start, n_stage, windows)

    def commit(self, candidate: int) -> None:
        won, anchor = self.windows[candidate].tokens, self.windows[-1].tokens
        changed = [i for i, (a, b) in enumerate(zip(won, anchor, strict=False)) if a != b]
        self.lookaheads.append(self.start + changed[0] if changed else None)
        super().commit(candidate)


def lopa_order(model: SingleModel, prompt: list[int], params: DecodingParams) -> tuple[dict[int, int], float]:
    """LoPA's filling order as ranks (round by round, the winning lookahead first) and its TPF."""
    recorder: CommitRecorder | None = None
    rounds: list[list[int]] = []

    def record(inner: Executor) -> Executor:
        nonlocal recorder
        recorder = CommitRecorder(inner)
        return recorder

    result = model.generate(prompt, params, record, on_step=lambda e: rounds.append([p for p, _ in e.fills]))
    assert recorder is not None
    order: list[int] = []
    for fills, lookahead in zip(rounds, recorder.lookaheads, strict=True):
        order += sorted(fills, key=lambda p: (p != lookahead, p))
    return complete_ranks(order, len(prompt), params.max_new_tokens), result.tpf


def complete_ranks(order: Sequence[int], prompt_length: int, budget: int) -> dict[int, int]:
    """Ranks of the given order, then every other generated position after them, by position."""
    rest = [p for p in range(prompt_length, prompt_length + budget) if p not in set(order)]
    return {p: i for i, p in enumerate([*order, *rest])}


def decode_in_order(model: SingleModel, example: Example, prompt: list[int], params: DecodingParams,
                    rank: dict[int, int]) -> tuple[float, bool]:
    result = model.generate(prompt, params, partial(Ordered, rank=rank))
    return result.tpf, score(example, model.decode(result.output_ids))


def run_orders(
    model: SingleModel,
    examples: Sequence[Example],
    base: DecodingParams,
    k: int,
    orders: int,
    seed: int = 0,
    log: TextIO | None = None,
) -> list[dict]:
    """One row per prompt: the random orders' TPFs and the marked ones (see the module doc)."""
    log = log or sys.stderr
    d2f, lopa = base.with_overrides(branches=0), base.with_overrides(branches=k)
    rows = []
    for index, example in enumerate(examples):
        prompt = model.encode(example.prompt)
        rng = random.Random(seed * 1_000_003 + index)
        positions = list(range(len(prompt), len(prompt) + base.max_new_tokens))
        tpfs, valid = [], 0
        for _ in range(orders):
            rng.shuffle(positions)
            tpf, ok = decode_in_order(model, example, prompt, d2f, {p: i for i, p in enumerate(positions)})
            tpfs.append(tpf)
            valid += ok
        rank, lopa_tpf = lopa_order(model, prompt, lopa)
        replayed, _ = decode_in_order(model, example, prompt, d2f, rank)
        own = model.generate(prompt, d2f).tpf
        rows.append({
            "prompt": example.prompt, "d2f_order": round(own, 3), "lopa_order": round(replayed, 3),
            "lopa": round(lopa_tpf, 3), "random_best": round(max(tpfs), 3),
            "random_median": round(statistics.median(tpfs), 3), "random_worst": round(min(tpfs), 3),
            "lopa_order_percentile": round(100 * sum(t <= replayed for t in tpfs) / len(tpfs), 1),
            "random_valid_pct": round(100 * valid / orders, 1), "_random": [round(t, 3) for t in tpfs],
        })
        print(f"prompt {index + 1}/{len(examples)}: random {min(tpfs):.2f}..{max(tpfs):.2f}, "
              f"LoPA's order {replayed:.2f}, D2F {own:.2f}, LoPA {lopa_tpf:.2f}", file=log, flush=True)
    return rows


def summary(rows: Sequence[dict]) -> dict:
    """Means over the prompts of every marked TPF, and how often LoPA's order beats every random one."""
    keys = ("d2f_order", "lopa_order", "lopa", "random_best", "random_median", "random_worst")
    out: dict = {key: round(statistics.fmean(r[key] for r in rows), 3) for key in keys}
    out["lopa_order_at_or_above_best_pct"] = round(
        100 * sum(r["lopa_order"] >= r["random_best"] for r in rows) / len(rows), 1)
    return out


MARKS = (  # (row key, marker, colour, label)
    ("d2f_order", "o", "tab:blue", "D2F (most confident first)"),
    ("lopa_order", "*", "tab:red", "LoPA's order, replayed"),
    ("lopa", "D", "tab:purple", "LoPA itself"),
)


def plot(rows: Sequence[dict], path: str) -> None:
    """Per prompt: the random orders' TPFs (grey), their best and worst (green), and the marks."""
    from lopa_bench.figures import figure

    with figure(path, width=max(6.4, 0.35 * len(rows) + 4)) as axis:
        for x, row in enumerate(rows):
            first = x == 0  # one legend entry per kind
            tpfs = row["_random"]
            spread = [x - 0.15 + 0.3 * i / max(1, len(tpfs) - 1) for i in range(len(tpfs))]
            axis.scatter(spread, tpfs, s=4, color="0.6", label="random orders" if first else None)
            axis.scatter([x, x], [row["random_best"], row["random_worst"]], marker="^", color="tab:green",
                         label="best and worst random" if first else None)
            for key, marker, colour, label in MARKS:
                axis.scatter([x], [row[key]], marker=marker, s=50, color=colour,
                             label=label if first else None)
        axis.set(xlabel="held-out prompt", ylabel="tokens per forward", ylim=(0, None),
                 title="TPF of filling orders (one-token fallback in the given order)")
        axis.set_xticks(range(len(rows)))
        axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the dots
