"""Where the model comes from: the configured path, else the bundled model (clear error if absent)."""

from __future__ import annotations

from pathlib import Path

from lopa.engine import bundled_model_dir
from lopa.serving.config import ConfigError


def model_path(configured: str) -> Path:
    path = Path(configured) if configured else bundled_model_dir()
    if not (path / "config.json").is_file():
        what = f"model.path {configured!r}" if configured else f"the bundled model ({path})"
        raise ConfigError(f"{what} has no config.json")
    return path
