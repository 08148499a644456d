"""`lopa bench commit`: the cost of the two-phase KV commit of the distributed path, per round.

With full attention a TO_CACHE block's K/V differ between branches (docs/decoding.md section 5):
each worker writes its branches' K/V into staging slots during its verification forward
(pre-write), and once the master has picked the winner, the rank holding it broadcasts the
winner's staged K/V and stored last logit, which every rank appends (winner commit, sent with the
next round). Per worker count W, a master and W workers on loopback (`lopa serve`'s launcher, gloo,
one thread each) decode the held-out prompts one at a time with LoPA k, and per round:
  - forward_ms: the slowest worker's verification forward, its pre-write included;
  - commit_ms: the slowest worker's winner commit (pack, broadcast, append);
  - coordination_ms: the rest of the master's round trip;
  all three from the master's lopa_step_seconds{phase}, as `lopa bench serving` reads them;
  - prewrite_ms: the staging copies of the busiest worker's rows: the same prompts decode with the
    same k in this process, and each round's staging (its rows and staged tokens, every layer's K
    and V) is replayed through a KV cache of the model's shape (KVCache.begin_stage, stage), timed
    outside the forward (a worker stages its rows only; the copy grows with the rows, so a round's
    copy is shared out as its rows are);
  - commit_kb: the bytes one winner commit broadcasts (all layers' K/V of the committed tokens and
    the fp32 last logit), averaged over the rounds (a round that caches nothing commits none).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence

from lopa.decoding.executor import BranchWindow, Executor
from lopa.model.kv_cache import KVCache
from lopa.serving.shared.config import Limits, parse_config, with_model_defaults
from lopa.serving.shared.model_dir import model_path
from lopa_bench.serving import bench_workers, workload
from lopa_bench.single import ExecutorProxy, SingleModel, Stats

Round = tuple[int, int, float]  # a round's rows, staged tokens and staging seconds


class RoundShapes(ExecutorProxy):
    """Notes each round's rows and staged tokens."""

    def __init__(self, inner: Executor, rounds: list[tuple[int, int]]) -> None:
        super().__init__(inner)
        self.rounds = rounds

    def verify(self, start: int, n_stage: int, windows: Sequence[BranchWindow]) -> Stats:
        self.rounds.append((len(windows), n_stage))
        return super().verify(start, n_stage, windows)


def prewrite(model: SingleModel, prompts: Sequence[str], kw: dict, repeat: int = 3) -> list[Round]:
    """(rows, staged tokens, staging seconds) of every round of the prompts' decodes: the staging of
    each round's shape timed on a KV cache like the model's (the fastest of `repeat`)."""
    from lopa.params import DecodingParams

    params = DecodingParams().with_overrides(**{k: v for k, v in kw.items() if k != "pin_branches"})
    shapes: list[tuple[int, int]] = []
    for prompt in prompts:
        model.generate(model.encode(prompt), params, lambda inner: RoundShapes(inner, shapes))
    kv = model.executor.model.caches[0]  # type: ignore[attr-defined]
    timed: dict[tuple[int, int], float] = {}
    for rows, n in dict.fromkeys(shapes):
        timed[rows, n] = min(_staging_s(kv, rows, n) for _ in range(repeat)) if n else 0.0
    return [(rows, n, timed[rows, n]) for rows, n in shapes]


def _staging_s(like: KVCache, rows: int, n: int) -> float:
    """Seconds to stage n tokens of `rows` rows, every layer, in a fresh cache shaped as `like`."""
    import torch

    cache = KVCache(like.num_layers, like.kv_heads, like.head_dim, n, like.dtype, like.device, rows)
    keys = torch.randn(1, rows * n, like.kv_heads, like.head_dim, dtype=like.dtype, device=like.device)
    cache.begin_stage(rows, n)
    began = time.perf_counter()
    for layer in range(like.num_layers):
        cache.stage(layer, keys, keys)
    if like.device.type == "cuda":
        torch.cuda.synchronize(like.device)
    return time.perf_counter() - began


def commit_row(rounds: Sequence[Round], workers: int, token_bytes: int, logit_bytes: int) -> dict:
    """Per round: the busiest worker's share of the staging copies, and the bytes a commit moves."""
    busiest = [seconds * math.ceil(rows / workers) / rows for rows, _, seconds in rounds]
    committed = [n * token_bytes + (logit_bytes if n else 0) for _, n, _ in rounds]
    return {
        "prewrite_ms": round(1000 * sum(busiest) / len(rounds), 4),
        "commit_kb": round(sum(committed) / len(rounds) / 1024, 2),
    }


def run(args: argparse.Namespace, worker_counts: Sequence[int], log: Callable[[str], None]) -> list[dict]:
    limits = {"queue_size": 64, "max_batch": 1, "max_branches": max(Limits.max_branches, args.branches)}
    config = parse_config({"model": {"path": args.model or ""}, "limits": limits})
    config = with_model_defaults(config, model_path(config.model.path))
    args.block_size, args.max_new_tokens = None, None
    kw, prompts = workload(args, args.requests)
    kw["attention"] = "full"  # the two-phase commit; block_causal needs no broadcast
    model = SingleModel.load(model_path(config.model.path))
    rounds = prewrite(model, prompts[2:], kw)
    kv = model.executor.model.caches[0]  # type: ignore[attr-defined]
    token_bytes = kv.packed_shape(1).numel() * kv.cache.element_size()
    logit_bytes = 4 * model.loaded.config.vocab_size
    rows = []
    for workers in worker_counts:
        split, _ = bench_workers(config, workers, args.requests, [1], kw, prompts)
        row = {"workers": workers, "k": args.branches, "step_ms": split["step_ms"],
               "forward_ms": split["forward_ms"], **commit_row(rounds, workers, token_bytes, logit_bytes),
               "commit_ms": split["commit_ms"], "coordination_ms": split["coordination_ms"]}
        forward = row["forward_ms"] or float("nan")
        row["prewrite_pct_of_forward"] = round(100 * row["prewrite_ms"] / forward, 2)
        row["commit_pct_of_forward"] = round(100 * row["commit_ms"] / forward, 1)
        rows.append(row)
        log(f"{workers} worker(s): forward {row['forward_ms']:.2f} ms, "
            f"pre-write {row['prewrite_ms']:.3f} ms, commit {row['commit_ms']:.2f} ms")
    return rows


def plot(rows: Sequence[dict], path: str) -> None:
    """Stacked per worker count: forward (its pre-write hatched at its base), commit, coordination."""
    from lopa_bench.figures import figure

    with figure(path) as axis:
        xs = [str(r["workers"]) for r in rows]
        prewrite_ms = [r["prewrite_ms"] for r in rows]
        rest = [r["forward_ms"] - r["prewrite_ms"] for r in rows]
        commit = [r["commit_ms"] for r in rows]
        axis.bar(xs, prewrite_ms, color="tab:red", label="pre-write (in the forward)")
        axis.bar(xs, rest, bottom=prewrite_ms, color="tab:blue", label="forward")
        tops = [r["forward_ms"] for r in rows]
        axis.bar(xs, commit, bottom=tops, color="tab:orange", label="winner commit")
        below = [a + b for a, b in zip(tops, commit, strict=True)]
        axis.bar(xs, [r["coordination_ms"] for r in rows], bottom=below, color="0.7", label="coordination")
        axis.set(xlabel="workers", ylabel="ms per round",
                 title=f"one round, LoPA k = {rows[0]['k']}, full attention")
        axis.legend(fontsize=8)
