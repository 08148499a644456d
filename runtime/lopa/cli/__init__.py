"""The `lopa` command: one subcommand per module, errors as one clear line."""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
from collections.abc import Sequence
from typing import Any

from lopa import __version__
from lopa.cli.decoding_flags import flag_name
from lopa.model.errors import CheckpointError
from lopa.params import InvalidParameter
from lopa.serving.shared.config import ConfigError
from lopa.serving.shared.listen import PORT_TAKEN_EXIT, PortTaken

# Commands that run a model in this process (`lopa worker` fits its threads once its logging is set).
# (`lopa train-bundled` sets its own --threads.)
IN_PROCESS_MODEL_COMMANDS = ("generate", "bench")


# Each command's module, in `lopa --help`'s order. A run imports only its own command's module:
# the master, the client and fetch-model start without torch (seconds, and memory, per process).
# `lopa bench` is the benchmarks' own package (lopa_bench), installed beside lopa: named here, never
# imported by lopa's code.
COMMANDS = {
    "generate": "lopa.cli.generate",
    "train-bundled": "lopa.cli.train",
    "bench": "lopa_bench.cli",
    "serve": "lopa.cli.serve",
    "master": "lopa.cli.master",
    "client": "lopa.cli.client",
    "worker": "lopa.cli.worker",
    "fetch-model": "lopa.cli.fetch",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; given a command, only that command's subparser is complete (the others are
    bare names, so that an unknown command is still refused with the list of them)."""
    parser = argparse.ArgumentParser(prog="lopa", description="LoPA decoding for D2F diffusion LMs")
    parser.add_argument("--version", action="version", version=version_line())
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        if command in (None, name):
            _command_module(name, module).add_parser(subparsers)
        else:
            subparsers.add_parser(name)
    _name_each_parser(parser)
    return parser


def _command_module(name: str, module: str) -> Any:
    """The command's module; SystemExit naming what is missing when its package is not installed."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name not in (module, module.partition(".")[0]):
            raise
        raise SystemExit(f"lopa {name}: error: its package {error.name} is not installed (it ships beside "
                         "lopa in runtime/: pip install ./runtime)") from None


def _name_each_parser(parser: argparse.ArgumentParser) -> None:
    """Every (sub)command's parser in its own defaults: an unknown flag is then refused with that
    command's usage (`lopa serve: error: ...`), not the top-level one's."""
    parser.set_defaults(_parser=parser)
    for action in parser._actions:  # argparse keeps its subcommands there, and nowhere public
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                _name_each_parser(sub)


def _command(argv: Sequence[str]) -> str | None:
    """The command named on the line, when its name comes first (no global flag before it)."""
    return argv[0] if argv and argv[0] in COMMANDS else None


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
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command(argv))
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command in IN_PROCESS_MODEL_COMMANDS:
        from lopa.host.cpu_budget import fit_torch_threads

        fit_torch_threads()  # a container's CPU limit, which torch does not see
    try:
        return int(args.handler(args) or 0)
    except InvalidParameter as error:
        # A field in capitals is an environment variable (LOPA_PORT_RANGE), named as it is set.
        where = error.field if error.field.isupper() else flag_name(error.field)
        parser.exit(2, f"lopa {args.command}: error: {where}: {error.reason}\n")
    except PortTaken as error:
        parser.exit(PORT_TAKEN_EXIT, f"lopa {args.command}: error: {error}\n")
    # OSError: a port that cannot be bound (the message names its config key), a file that cannot be read.
    except (CheckpointError, ConfigError, OSError) as error:
        parser.exit(1, f"lopa {args.command}: error: {error}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
