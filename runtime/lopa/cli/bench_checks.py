"""`lopa bench ablation` and `lopa bench orders`: the LoPA paper's checks on the bundled model.

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

from lopa.bench import ablation, orders
from lopa.bench.rows import markdown_table, public
from lopa.bench.single import SingleModel
from lopa.bundled import bundled_model_dir, tasks
from lopa.bundled.defaults import model_defaults
from lopa.params import MAX_BRANCHES, DecodingParams, InvalidParameter


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
    from lopa.cli.bench import parse_ks

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


def _machine() -> dict[str, Any]:
    from lopa.bench.tpf import machine

    return machine()
