"""The `lopa` command: one subcommand per module, errors as one clear line."""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Sequence

from lopa import __version__
from lopa.cli import bench, client, fetch, generate, master, serve, train, worker
from lopa.cli.decoding_flags import flag_name
from lopa.model.errors import CheckpointError
from lopa.params import InvalidParameter
from lopa.serving.shared.config import ConfigError

# Commands that run a model in this process (`lopa worker` fits its threads once its logging is set).
# (`lopa train-bundled` sets its own --threads.)
IN_PROCESS_MODEL_COMMANDS = ("generate", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lopa", description="LoPA decoding for D2F diffusion LMs")
    parser.add_argument("--version", action="version", version=version_line())
    subparsers = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(subparsers)
    train.add_parser(subparsers)
    bench.add_parser(subparsers)
    serve.add_parser(subparsers)
    master.add_parser(subparsers)
    client.add_parser(subparsers)
    worker.add_parser(subparsers)
    fetch.add_parser(subparsers)
    return parser


def version_line() -> str:
    """What a bug report needs: lopa's version and the runtime it runs on (torch imported lazily
    elsewhere, so its version is read from the installed package's metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    return f"lopa {__version__} (torch {torch_version}, Python {platform.python_version()})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in IN_PROCESS_MODEL_COMMANDS:
        from lopa.host.cpu_budget import fit_torch_threads

        fit_torch_threads()  # a container's CPU limit, which torch does not see
    try:
        return int(args.handler(args) or 0)
    except InvalidParameter as error:
        parser.exit(2, f"lopa {args.command}: error: {flag_name(error.field)}: {error.reason}\n")
    # OSError: a port that cannot be bound (the message names its config key), a file that cannot be read.
    except (CheckpointError, ConfigError, OSError) as error:
        parser.exit(1, f"lopa {args.command}: error: {error}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
