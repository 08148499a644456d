"""Lists the functions longer than the team's limit (50 lines, `def` to last line) and exits 1 if any.

A longer function says why at its top: a comment `# long: <reason>` before its first statement
(after its docstring). `make lint` runs it over the code that is written by hand: runtime/,
operator/ and tools/, without the tests and the generated gRPC stubs (*_pb2.py, *_pb2_grpc.py).

    python tools/function_length.py [--limit N] [PATH ...]
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

LIMIT = 50
REASON = "# long:"
ROOTS = ("runtime", "operator", "tools")
GENERATED = ("_pb2.py", "_pb2_grpc.py")
SKIPPED_DIRS = {"tests", ".venv", "build", "dist", "__pycache__"}


def sources(roots: list[Path]) -> Iterator[Path]:
    for root in roots:
        paths = [root] if root.is_file() else sorted(root.rglob("*.py"))
        for path in paths:
            if not path.name.endswith(GENERATED) and not SKIPPED_DIRS & set(path.parts):
                yield path


def long_functions(path: Path, limit: int = LIMIT) -> Iterator[tuple[int, str, int]]:
    """(line, name, length) of every function or method in `path` longer than `limit` lines that
    gives no reason for it."""
    source = path.read_text()
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > limit and not has_reason(node, lines):
                yield node.lineno, node.name, length


def has_reason(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> bool:
    """A `# long:` comment between the signature and the first statement after the docstring."""
    body = node.body
    docstring = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
    first = body[1] if docstring and len(body) > 1 else body[0]
    return any(line.strip().startswith(REASON) for line in lines[node.lineno - 1 : first.lineno - 1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=LIMIT, help="longest allowed (default: %(default)s)")
    parser.add_argument("paths", nargs="*", type=Path,
                        help=f"files or directories (default: {' '.join(ROOTS)})")
    args = parser.parse_args(argv)
    top = Path(__file__).resolve().parents[1]
    found = [
        f"{path.relative_to(top) if path.is_relative_to(top) else path}:{line}: {name} is {length} lines "
        f"long (limit {args.limit})"
        for path in sources(args.paths or [top / root for root in ROOTS])
        for line, name, length in long_functions(path, args.limit)
    ]
    if found:
        print("\n".join(found), file=sys.stderr)
        return 1
    print(f"no function over {args.limit} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
