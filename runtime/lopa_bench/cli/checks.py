"""`lopa bench ablation`, `orders`, `commit` and `options`: the LoPA paper's checks and open
questions on the bundled model.

Each prints a table, and writes <name>.json and <name>.png into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lopa.bundled import bundled_model_dir, tasks
from lopa.model.decoding_defaults import model_defaults
from lopa.params import MAX_BRANCHES, DecodingParams, InvalidParameter
from lopa_bench import ablation, orders
from lopa_bench.cli.lists import parse_ks
from lopa_bench.rows import markdown_table, public
from lopa_bench.single import SingleModel


def add_parsers(kinds: argparse._SubParsersAction) -> None:
    abl = kinds.add_parser(
        "ablation",
        help="k branches verified per round; the winner by LoPA's score, at random, or the anchor",
        description="Isolate the value of choosing the filling order from the value of verifying more "
        "rows: every round verifies k lookaheads and the anchor; only the winner choice differs.",
    )
    _common(abl, limit=100)
    abl.add_argument("--ks", default="1,2,3,5,7", help="comma-separated k values (lookahead branches)")
    abl.add_argument("--choices", default=",".join(ablation.CHOICES), help="winner choices, comma-separated")
    abl.set_defaults(handler=lambda args: _run(args, run_ablation))
    order = kinds.add_parser(
        "orders",
        help="TPF of many random token-filling orders per prompt, with LoPA's and D2F's orders marked",
        description="Per held-out prompt: D2F with its one-token fallback following random orders, "
        "D2F's own order, LoPA's order replayed, and LoPA itself.",
    )
    _common(order, limit=20)
    order.add_argument("--orders", type=int, default=100, help="random orders per prompt")
    order.add_argument("--k", type=int, default=7, help="LoPA's lookahead branches (its order is replayed)")
    order.set_defaults(handler=lambda args: _run(args, run_orders))
    options = kinds.add_parser(
        "options",
        help="the branch score and branch count settings (branch_score, branch_policy), measured",
        description="Decode the held-out prompts with each branch score (the paper's mean, beta 0.5, the "
        "minimum, block_min, fills) and each branch policy (fixed, auto) for each k.",
    )
    _common(options, limit=100)
    options.add_argument("--ks", default="1,3,5,7", help="comma-separated k values (auto: the ceiling)")
    options.set_defaults(handler=lambda args: _run(args, run_options))
    commit = kinds.add_parser(
        "commit",
        help="the distributed path's pre-write and winner commit against the forward, per round",
        description="For each worker count: a master and workers on loopback decode the held-out "
        "prompts one at a time with LoPA, full attention; per round the forward, the pre-write "
        "inside it, the winner commit and the coordination (see lopa_bench.commit_cost).",
    )
    commit.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    commit.add_argument("--out", required=True, help="directory for commit.json and commit.png")
    commit.add_argument("--workers", default="1,2,3", help="worker counts, comma-separated")
    commit.add_argument("--requests", type=int, default=16, help="requests per worker count, one at a time")
    commit.add_argument("--branches", type=int, default=5, help="LoPA's lookahead branches k")
    commit.set_defaults(handler=run_commit)


def _common(parser: argparse.ArgumentParser, limit: int) -> None:
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    parser.add_argument("--out", required=True, help="directory for the JSON and the PNG")
    parser.add_argument("--limit", type=int, default=limit, help="held-out prompts to decode")
    parser.add_argument("--attention", default="full", choices=["full", "block_causal"], help="attention")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random choices")


Check = Callable[[argparse.Namespace, SingleModel, DecodingParams, Path], dict[str, Any]]


def _run(args: argparse.Namespace, check: Check) -> int:
    for name in ("limit", "threads"):
        if getattr(args, name) < 1:
            raise InvalidParameter(name, f"must be >= 1, got {getattr(args, name)}")
    model_dir = Path(args.model) if args.model else bundled_model_dir()
    base = model_defaults(model_dir).with_overrides(attention=args.attention)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)  # before the run: an --out it cannot write loses minutes
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        report = check(args, SingleModel.load(model_dir), base, out)
    finally:
        torch.set_num_threads(threads)  # process-wide: restore it for in-process callers
    report.update(params={k: getattr(v, "value", v) for k, v in vars(base).items()}, machine=_machine())
    path = out / f"{args.bench}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path} and {out / f'{args.bench}.png'}", file=sys.stderr)
    return 0


def run_ablation(args: argparse.Namespace, model: SingleModel, base: DecodingParams, out: Path) -> dict:
    ks = parse_ks(args.ks)
    choices = [c.strip() for c in args.choices.split(",") if c.strip()]
    unknown = [c for c in choices if c not in ablation.CHOICES]
    if unknown or not choices:
        known = ", ".join(ablation.CHOICES)
        raise InvalidParameter("choices", f"each must be one of {known}, got {args.choices!r}")
    rows = ablation.run_ablation(model, tasks.held_out(args.limit), base, ks, choices, args.seed)
    print(markdown_table(rows))
    ablation.plot(rows, str(out / "ablation.png"))
    return {"examples": args.limit, "rows": rows}


def run_orders(args: argparse.Namespace, model: SingleModel, base: DecodingParams, out: Path) -> dict:
    if args.orders < 1:
        raise InvalidParameter("orders", f"must be >= 1, got {args.orders}")
    if not 1 <= args.k <= MAX_BRANCHES:
        raise InvalidParameter("k", f"must be in [1, {MAX_BRANCHES}], got {args.k}")
    rows = orders.run_orders(model, tasks.held_out(args.limit), base, args.k, args.orders, args.seed)
    summary = orders.summary(rows)
    print(markdown_table([public(r) for r in rows]))
    print(markdown_table([{"prompts": len(rows), **summary}]))
    orders.plot(rows, str(out / "orders.png"))
    return {"examples": args.limit, "orders": args.orders, "k": args.k, "summary": summary, "rows": rows}


def run_options(args: argparse.Namespace, model: SingleModel, base: DecodingParams, out: Path) -> dict:
    from lopa_bench import options

    ks = parse_ks(args.ks)
    examples = tasks.held_out(args.limit)
    scores = options.sweep(model, examples, base, ks, options.SCORES, "score")
    policies = options.sweep(model, examples, base, ks, options.POLICIES, "policy")
    print(markdown_table(scores))
    print(markdown_table(policies))
    options.plot(scores, policies, str(out / "options.png"))
    return {"examples": args.limit, "branch_score": scores, "branch_policy": policies}


def run_commit(args: argparse.Namespace) -> int:
    from lopa_bench import commit_cost
    from lopa_bench.concurrency import positive_ints

    workers = positive_ints(args.workers, "workers", "worker count")
    if args.requests < 1:
        raise InvalidParameter("requests", f"must be >= 1, got {args.requests}")
    if not 1 <= args.branches <= MAX_BRANCHES:
        raise InvalidParameter("branches", f"must be in [1, {MAX_BRANCHES}], got {args.branches}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.attention = None  # the bench decodes with full attention: the two-phase commit
    rows = commit_cost.run(args, workers, lambda line: print(line, file=sys.stderr, flush=True))
    print(markdown_table(rows))
    commit_cost.plot(rows, str(out / "commit.png"))
    report = {"requests": args.requests, "rows": rows, "machine": _machine()}
    (out / "commit.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out / 'commit.json'} and {out / 'commit.png'}", file=sys.stderr)
    return 0


def _machine() -> dict[str, Any]:
    from lopa_bench.tpf import machine

    return machine()
