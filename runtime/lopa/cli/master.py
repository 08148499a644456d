"""`lopa master --config FILE`: the client-facing gRPC server of a worker group."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from lopa.serving.config import load_config


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "master",
        help="run the LoPA master (client gRPC API + health) over a group of branch workers",
        description="Serve Generate/GenerateStream; decode over the workers named in the config file.",
    )
    parser.add_argument("--config", required=True, help="the serving YAML file (docs/lopa.yaml)")
    parser.add_argument("--log-level", default="INFO")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from lopa.serving.master import serve_master

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_config(args.config)
    signal.signal(signal.SIGTERM, _interrupt)  # Kubernetes stops pods with SIGTERM
    try:
        asyncio.run(serve_master(config))
    except KeyboardInterrupt:
        return 0
    return 0


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt
