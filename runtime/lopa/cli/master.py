"""`lopa master --config FILE`: the client-facing gRPC server of a worker group."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal

from lopa.cli.preflight import listen_problem
from lopa.serving.shared.config import ServingConfig
from lopa.serving.shared.parent_watch import watch_parent


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
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    watch_parent()  # started by `lopa serve`: stop when it is gone, however it died
    config = master_config(args.config)
    problem = listen_problem(config.master.listen)
    if problem:  # gRPC says only "Failed to bind", after an error line of its own
        raise OSError(f"master.listen: {problem}")
    asyncio.run(_serve_until_signalled(config))
    return 0


def master_config(path: str) -> ServingConfig:
    """The file, with the model's own decoding defaults for the decoding keys it leaves out."""
    from lopa.serving.shared.model_dir import role_config  # reads the model: only for this command

    return role_config(path)


async def _serve_until_signalled(config: ServingConfig) -> None:
    """Serve until SIGTERM (how Kubernetes stops pods): then drain (no new request, the queued and
    running ones finish, at most limits.request_timeout_s) and shut down in order. A second SIGTERM,
    or SIGINT, stops at once.

    The signals act inside the event loop; raising KeyboardInterrupt from a signal handler instead
    can land in the middle of any object's construction at shutdown.
    """
    from lopa.serving.master.server import serve_master

    drain = asyncio.Event()
    serving = asyncio.ensure_future(serve_master(config, drain=drain))
    loop = asyncio.get_running_loop()

    def on_term() -> None:
        if drain.is_set():
            serving.cancel()
        drain.set()

    loop.add_signal_handler(signal.SIGTERM, on_term)
    loop.add_signal_handler(signal.SIGINT, serving.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await serving
