"""`lopa worker --config FILE --rank N`: a branch worker (rank from --rank or $LOPA_RANK)."""

from __future__ import annotations

import argparse
import logging
import os
import signal

from lopa.serving.collective import JoinError
from lopa.serving.config import load_config


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "worker",
        help="run a branch worker (model replica + KV cache) of a LoPA master",
        description="Load the model, join the collective group, serve the master's step stream.",
    )
    parser.add_argument("--config", required=True, help="the serving YAML file (docs/lopa.yaml)")
    parser.add_argument("--rank", type=int, default=None, help="this worker's rank (default: $LOPA_RANK)")
    parser.add_argument("--log-level", default="INFO")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from lopa.serving.worker import exit_now, serve_worker  # torch import only for this command

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rank = args.rank if args.rank is not None else os.environ.get("LOPA_RANK")
    if rank is None:
        raise SystemExit("lopa worker: error: --rank or $LOPA_RANK is required")
    config = load_config(args.config)
    # A worker has nothing to flush, and may be blocked inside a collective join: stop at once.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    try:
        code = serve_worker(config, int(rank))
    except JoinError as error:
        logging.getLogger("lopa.worker").error("%s", error)
        exit_now(1)
    exit_now(code)  # skip collective teardown: a dead peer could block it
    return code
