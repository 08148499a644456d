"""The one error a bad checkpoint raises: it names the file (and what in it) that is wrong."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint, tokenizer or adapter file is missing or inconsistent.

    `path` is the offending file; `message` says which field or tensor is wrong.
    """

    def __init__(self, path: str | Path, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = str(path)
        self.message = message


def read_json_object(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file as a dict; CheckpointError names the file when it is missing or bad."""
    if not path.is_file():
        raise CheckpointError(path, "file not found")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(path, f"not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(path, "expected a JSON object")
    return raw
