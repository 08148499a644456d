"""The command-line reference: every `lopa` and `lopa-operator` command's own `--help`."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
from collections.abc import Iterator

HELP_COLUMNS = "100"  # argparse wraps at the terminal's width: fixed, so the page is the same everywhere


def render() -> str:
    from lopa.cli import build_parser

    lines = [
        "# Command-line reference",
        "",
        "Every command's own `--help`, as `lopa <command> --help` prints it. `lopa` is the runtime "
        "(local serving, the master and the workers of a group, benchmarks); `lopa-operator` is the "
        "Kubernetes operator.",
        "",
    ]
    with fixed_width():
        commands = [*walk(build_parser(), ["lopa"]), (["lopa-operator"], operator_help())]
    for path, text in commands:
        heading = "#" * min(len(path) + 1, 4)
        lines += [f"{heading} `{' '.join(path)}`", "", "```text", text.rstrip(), "```", ""]
    return "\n".join(lines)


@contextlib.contextmanager
def fixed_width() -> Iterator[None]:
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        yield
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved


def walk(parser: argparse.ArgumentParser, path: list[str]) -> Iterator[tuple[list[str], str]]:
    """(command path, its help) for the parser and every subcommand below it, in the order declared."""
    yield path, parser.format_help()
    for action in parser._actions:  # argparse exposes subcommands only through its actions
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk(sub, [*path, name])


def operator_help() -> str:
    """`lopa-operator --help`: its parser is built inside parse(), so its own exit is captured. Its
    defaults read LOPA_OPERATOR_* from the environment: those are left out, so the page shows the
    defaults of a pod that sets none."""
    from lopa_operator.__main__ import parse

    saved = {key: os.environ.pop(key) for key in list(os.environ) if key.startswith("LOPA_OPERATOR_")}
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            parse(["--help"])
    finally:
        os.environ.update(saved)
    return out.getvalue()
