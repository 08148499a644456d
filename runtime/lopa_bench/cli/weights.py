"""`lopa bench weights`: FP8 weights against the dtype's: logit error, exact match, greedy agreement."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lopa.cli.preflight import device_problem, weights_problem
from lopa.params import InvalidParameter
from lopa.serving.shared.config import DTYPES
from lopa_bench.cli.lists import parse_ks
from lopa_bench.rows import check_json, markdown_table, show_row


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser(
        "weights",
        help="FP8 weights against the dtype's on one model: logit error, exact match, greedy agreement",
        description="Load the model twice (dtype and fp8 weights), compare one forward's logits over "
        "held-out prompts, then decode the held-out split greedily at each k with both; print a table "
        "and write JSON.",
    )
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    parser.add_argument("--adapter", default=None, help="PEFT LoRA adapter directory, merged at load")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (default cpu)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="model dtype (default float32)")
    parser.add_argument("--limit", type=int, default=300, help="held-out prompts to decode (0: logits only)")
    parser.add_argument("--ks", default="0,7", help="lookahead branches to decode with (default 0,7)")
    parser.add_argument("--json", default=None, help="write the rows and the setup here")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    ks = parse_ks(args.ks)
    if args.limit < 0:
        raise InvalidParameter("limit", f"must be >= 0, got {args.limit}")
    check_json(args.json)
    problem = device_problem(args.device) or weights_problem("fp8", args.device)
    if problem:
        raise InvalidParameter("device", problem)
    import torch

    from lopa.bundled import tasks
    from lopa.engine import LocalEngine, bundled_model_dir
    from lopa.model.decoding_defaults import model_defaults
    from lopa_bench import weights

    model_dir = Path(args.model) if args.model else bundled_model_dir()
    engines = {
        kind: LocalEngine.from_dirs(model_dir, args.adapter, args.dtype, args.device, max_batch=1,
                                    weights=kind)
        for kind in ("dtype", "fp8")
    }
    device = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    setup = {"device": device, "torch": torch.__version__, "dtype": args.dtype, "model": str(model_dir),
             "adapter": args.adapter}
    print(json.dumps(setup), flush=True)
    try:
        examples = tasks.held_out(max(args.limit, 16))
        prompts = [engines["dtype"].encode(e.prompt) for e in examples[:16]]
        rows = [weights.logits_row(engines["dtype"].loaded.model, engines["fp8"].loaded.model, prompts)]
        show_row(rows[-1])
        base = model_defaults(model_dir)
        for k in ks if args.limit else []:
            params = base.with_overrides(branches=k)
            decoded = {kind: weights.decode_all(engine, examples[: args.limit], params)
                       for kind, engine in engines.items()}
            rows.append(weights.decode_row(k, decoded["dtype"], decoded["fp8"]))
            show_row(rows[-1])
    finally:
        for engine in engines.values():
            engine.close()
    for kind in ("logits", "decode"):
        picked = [{key: v for key, v in r.items() if key != "kind"} for r in rows if r["kind"] == kind]
        if picked:
            print(f"\n{kind} (fp8 weights against {args.dtype}, {setup['device']})")
            print(markdown_table(picked))
    if args.json:
        Path(args.json).write_text(json.dumps({"setup": setup, "rows": rows}, indent=2) + "\n")
    return 0
