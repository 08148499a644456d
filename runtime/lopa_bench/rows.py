"""Row benchmarks (serving, transport): one JSON line per row as it is measured, then a table."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from lopa.params import InvalidParameter


def public(row: dict) -> dict:
    """The row without its working keys (named "_...": kept for ratios, not for the reader)."""
    return {key: value for key, value in row.items() if not key.startswith("_")}


def show_row(row: dict) -> None:
    """Progress: each row as soon as it is measured (a sweep can take minutes)."""
    print(json.dumps(public(row)), flush=True)


def markdown_table(rows: Sequence[dict]) -> str:
    rows = [public(row) for row in rows]
    header = list(dict.fromkeys(key for row in rows for key in row))  # every key, first-seen order
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(row.get(h, "")) for h in header) + " |" for row in rows]
    return "\n".join(lines)


def check_json(path: str | None) -> None:
    """--json is written when the run ends, minutes later: its directory must exist now."""
    directory = Path(path).absolute().parent if path else None
    if directory is not None and not directory.is_dir():
        raise InvalidParameter("json", f"no directory {str(directory)!r} to write {path!r} in")


def finish(rows: Sequence[dict], json_path: str | None) -> None:
    """Print the table; write the rows as JSON when asked."""
    print(markdown_table(rows))
    if json_path:
        Path(json_path).write_text(json.dumps([public(row) for row in rows], indent=2) + "\n")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (q in 0-100) of `values`, linear between the closest ranks (0.0 of none)."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
