"""The one error a bad checkpoint raises: it names the file (and what in it) that is wrong."""

from __future__ import annotations

from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint, tokenizer or adapter file is missing or inconsistent.

    `path` is the offending file; `message` says which field or tensor is wrong.
    """

    def __init__(self, path: str | Path, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = str(path)
        self.message = message
