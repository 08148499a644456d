"""`lopa worker --config FILE --rank N`: a branch worker (rank from --rank or $LOPA_RANK)."""

from __future__ import annotations

import argparse
import logging
import os
import signal

from lopa import performance
from lopa.cli.preflight import device_problem, weights_problem
from lopa.params import InvalidParameter
from lopa.serving.shared.config import ConfigError
from lopa.serving.shared.parent_watch import watch_parent
from lopa.serving.worker.collective import JoinError


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
    from lopa.serving.shared.model_dir import role_config  # reads the model: only for this command

    watch_parent()  # started by `lopa serve`: stop when it is gone, however it died
    config = role_config(args.config)  # read as the master reads it: same defaults, same checks
    performance.install(config.performance)  # before the model loads: how it runs on its device
    rank = worker_rank(args.rank, os.environ.get("LOPA_RANK"), config.workers.count)
    problem = device_problem(config.model.device)
    if problem:
        raise ConfigError(f"{args.config}: model.device: {problem}")
    problem = weights_problem(config.model.weights, config.model.device)
    if problem:  # before the (long) load
        raise ConfigError(f"{args.config}: model.weights: {problem}")
    from lopa.serving.worker.service import exit_now, serve_worker  # torch import only for this command

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from lopa.host.cpu_budget import fit_torch_threads

    fit_torch_threads()  # a pod's CPU limit, which torch does not see
    # A worker has nothing to flush, and may be blocked inside a collective join: stop at once.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    try:
        code = serve_worker(config, rank)
    except JoinError as error:
        logging.getLogger("lopa.worker").error("%s", error)
        exit_now(1)
    exit_now(code)  # skip collective teardown: a dead peer could block it
    return code


def worker_rank(flag: int | None, env: str | None, count: int) -> int:
    """--rank, else $LOPA_RANK (a StatefulSet pod's index); InvalidParameter unless in [0, count)."""
    if flag is None and env is None:
        raise InvalidParameter("rank", "required (or set $LOPA_RANK)")
    if flag is None:
        try:
            flag = int(env or "")
        except ValueError:
            raise InvalidParameter("rank", f"$LOPA_RANK must be an integer, got {env!r}") from None
    if not 0 <= flag < count:
        raise InvalidParameter("rank", f"{flag} outside [0, workers.count={count})")
    return flag
