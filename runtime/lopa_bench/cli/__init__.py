"""`lopa bench`: its subcommands' flags, and `lopa bench tpf` (LoPA vs D2F on the bundled task
suite's held-out split) here; the benchmarks' own modules register the others.

checks       `ablation`, `orders`, `commit`, `options`: the LoPA paper's checks
clients      `clients`: guidellm and inference-perf against `lopa serve`
concurrency  `concurrency`: the sweep on the local engine
lists        the comma-separated list flags (--ks, --modes)
products     `products`: a step's matrix products, bf16 against FP8 kernels
step         `step` and `write-checkpoint`
weights      `weights`: FP8 weights against the dtype's
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from lopa.bundled import tasks
from lopa.engine import LocalEngine, bundled_model_dir
from lopa.model.decoding_defaults import model_defaults
from lopa.params import InvalidParameter
from lopa_bench import edges as edges_bench
from lopa_bench import samples as samples_bench
from lopa_bench import serving as serving_bench
from lopa_bench import shared_prompt as shared_prompt_bench
from lopa_bench import stream_cost as stream_cost_bench
from lopa_bench import transport as transport_bench
from lopa_bench.cli import checks as bench_checks
from lopa_bench.cli import clients as bench_clients
from lopa_bench.cli import concurrency as bench_concurrency
from lopa_bench.cli import products as bench_products
from lopa_bench.cli import step as bench_step
from lopa_bench.cli import weights as bench_weights
from lopa_bench.cli.lists import parse_ks, parse_modes
from lopa_bench.report import plot, table, write_json
from lopa_bench.tpf import KS, MODES, run_sweep

DEFAULT_EXAMPLES = 300  # the published held-out set size


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmarks: tpf, step, write-checkpoint, products, weights, concurrency, serving, transport, "
        "clients, ablation, orders, options, commit, edges, samples, shared-prompt, stream-cost",
    )
    kinds = parser.add_subparsers(dest="bench", required=True)
    tpf = kinds.add_parser(
        "tpf",
        help="TPF, accuracy and tokens/s of D2F (k=0) and LoPA k>0, both attention modes",
        description="Decode the held-out split with D2F and LoPA; print a table, write JSON and a PNG.",
    )
    tpf.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    tpf.add_argument("--out", required=True, help="directory for tpf.json and tpf.png")
    tpf.add_argument("--limit", type=int, default=DEFAULT_EXAMPLES, help="held-out prompts to decode")
    tpf.add_argument("--ks", default=",".join(map(str, KS)), help="comma-separated k values (0 = D2F)")
    tpf.add_argument("--modes", default=",".join(MODES), help="attention modes, comma-separated")
    tpf.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    tpf.add_argument("--tau-conf", type=float, default=None, help="override the model's default tau_conf")
    tpf.add_argument("--tau-add", type=float, default=None, help="override the model's default tau_add")
    tpf.add_argument("--tau-act", type=float, default=None, help="override the model's default tau_act")
    tpf.add_argument("--block-size", type=int, default=None, help="override the model's default block size")
    tpf.add_argument("--conf", default=None, choices=["prob", "neg_entropy", "margin"], help="Conf kind")
    tpf.set_defaults(handler=run)
    bench_step.add_parsers(kinds)
    bench_products.add_parser(kinds)
    bench_weights.add_parser(kinds)
    bench_concurrency.add_parser(kinds)
    serving_bench.add_parser(kinds)
    transport_bench.add_parser(kinds)
    bench_clients.add_parser(kinds)
    bench_checks.add_parsers(kinds)
    edges_bench.add_parser(kinds)
    samples_bench.add_parser(kinds)
    shared_prompt_bench.add_parser(kinds)
    stream_cost_bench.add_parser(kinds)


def run(args: argparse.Namespace) -> int:
    for name in ("limit", "threads"):
        if getattr(args, name) < 1:
            raise InvalidParameter(name, f"must be >= 1, got {getattr(args, name)}")
    args.ks, args.modes = parse_ks(args.ks), parse_modes(args.modes)  # before the model loads
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)  # process-wide setting: restore it for in-process callers


def _run(args: argparse.Namespace) -> int:
    model_dir = Path(args.model) if args.model else bundled_model_dir()
    base = model_defaults(model_dir).with_overrides(
        tau_conf=args.tau_conf,
        tau_add=args.tau_add,
        tau_act=args.tau_act,
        block_size=args.block_size,
        conf=args.conf,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)  # before the sweep: an --out it cannot write loses minutes of it
    engine = LocalEngine.from_dirs(model_dir)
    examples = tasks.held_out(args.limit)
    sweep = run_sweep(engine, examples, base, args.ks, args.modes)
    print(table(sweep))
    json_path, png_path = write_json(sweep, out / "tpf.json"), plot(sweep, out / "tpf.png")
    print(f"wrote {json_path} and {png_path}", file=sys.stderr)
    return 0
