"""`lopa bench clients`: guidellm and inference-perf against `lopa serve`, beside lopa's own numbers."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lopa.params import InvalidParameter
from lopa_bench.clients import toolchain
from lopa_bench.clients.compare import TOLERANCE
from lopa_bench.clients.results import Load
from lopa_bench.clients.runner import Plan, execute
from lopa_bench.clients.served import ServeOptions


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser(
        "clients",
        help="guidellm / inference-perf (their default request options) against lopa serve",
        description="Build the clients' venvs (tools/bench-clients/setup.sh, Python >= 3.12), start `lopa "
        "serve`, send each client's default request bodies once, run each client at a constant rate, then "
        "compare their failures, token counts, TTFT and TPOT with lopa's own counters and histograms. "
        "Prints a table; writes OUT/clients.json and each client's report under OUT. Exit status 0 when "
        "every check passes, 1 otherwise.",
    )
    parser.add_argument("--out", required=True, help="directory for the reports (created if missing)")
    parser.add_argument("--clients", default=",".join(toolchain.CLIENTS),
                        help="comma-separated, run in this order (default: %(default)s)")
    parser.add_argument("--rate", type=float, default=Load.rate,
                        help="requests per second (default: %(default)s)")
    parser.add_argument("--seconds", type=int, default=Load.seconds,
                        help="load duration in seconds (default: %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=Load.prompt_tokens,
                        help="prompt length in the model's tokens (default: %(default)s)")
    parser.add_argument("--output-tokens", type=int, default=Load.output_tokens,
                        help="max_tokens of every request (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=ServeOptions.workers, help="lopa serve --workers")
    parser.add_argument("--api-key", default=None,
                        help="lopa serve --api-key: the server asks for it, the clients send it")
    parser.add_argument("--branches", type=int, default=ServeOptions.branches, help="lopa serve --branches")
    parser.add_argument("--model", default=None,
                        help="checkpoint directory with a Hugging Face tokenizer "
                        "(default: the bundled model)")
    parser.add_argument("--compat", action="store_true",
                        help="send ignore_eos: false (guidellm extras, inference-perf server.ignore_eos): "
                        "the setting that runs against a server refusing ignore_eos")
    parser.add_argument("--guidellm-endpoint", choices=("completions", "chat"), default="chat",
                        help="guidellm's request format: chat (its own default; the model needs a chat "
                        "template, as the bundled model has) or completions (default: %(default)s)")
    parser.add_argument("--no-streaming", action="store_true",
                        help="inference-perf's own default: unstreamed requests "
                        "(it then measures no TTFT / TPOT)")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE,
                        help="TTFT / TPOT: largest |client - lopa| / lopa that passes (default: %(default)s)")
    parser.add_argument("--no-build", action="store_true",
                        help="use the venvs already built; fail if missing")
    parser.set_defaults(handler=run)


def plan_from(args: argparse.Namespace) -> Plan:
    clients = tuple(c.strip() for c in args.clients.split(",") if c.strip())
    unknown = sorted(set(clients) - set(toolchain.CLIENTS))
    if not clients or unknown:
        known = ", ".join(toolchain.CLIENTS)
        raise InvalidParameter("clients", f"must name some of {known}, got {args.clients!r}")
    for name in ("seconds", "prompt_tokens", "output_tokens", "workers"):
        if getattr(args, name) < 1:
            raise InvalidParameter(name, f"must be >= 1, got {getattr(args, name)}")
    if args.rate <= 0:
        raise InvalidParameter("rate", f"must be > 0, got {args.rate}")
    load = Load(args.rate, args.seconds, args.prompt_tokens, args.output_tokens)
    serve = ServeOptions(workers=args.workers, branches=args.branches, model=args.model, api_key=args.api_key)
    return Plan(out=Path(args.out), clients=clients, load=load, serve=serve, compat=args.compat,
                guidellm_endpoint=args.guidellm_endpoint, inference_perf_streaming=not args.no_streaming,
                tolerance=args.tolerance, build=not args.no_build)


def run(args: argparse.Namespace) -> int:
    plan = plan_from(args)
    try:
        report = execute(plan)
    except toolchain.ToolchainError as error:
        print(f"lopa bench clients: error: {error}", file=sys.stderr)
        return 3 if isinstance(error, toolchain.NoPython) else 1
    verdict = "all checks pass" if report["passed"] else f"{report['failed_checks']} checks fail"
    print(f"lopa bench clients: {verdict}; wrote {plan.out / 'clients.json'}", flush=True)
    return 0 if report["passed"] else 1
