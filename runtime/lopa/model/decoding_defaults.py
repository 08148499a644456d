"""The decoding parameters a checkpoint is meant to be served with (`lopa_defaults.json`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lopa.model.config import CONFIG_FILE, ModelConfig
from lopa.model.errors import CheckpointError, read_json_object
from lopa.model.families import family_named
from lopa.params import DecodingParams, InvalidParameter

DEFAULTS_FILE = "lopa_defaults.json"


def read_defaults(model_dir: str | Path) -> dict[str, Any]:
    """The raw overrides in model_dir/lopa_defaults.json ({} when the file is absent)."""
    path = Path(model_dir) / DEFAULTS_FILE
    if not path.is_file():
        return {}
    raw = read_json_object(path)
    return {k: v for k, v in raw.items() if not k.startswith("_")}  # "_comment" keys are notes


def family_defaults(model_dir: str | Path) -> dict[str, Any]:
    """The D2F settings the authors of the checkpoint's family evaluate with (lopa.model.families;
    {} without a config.json)."""
    if not (Path(model_dir) / CONFIG_FILE).is_file():
        return {}
    return dict(family_named(ModelConfig.from_dir(model_dir).family).decoding_defaults)


def model_defaults(model_dir: str | Path) -> DecodingParams:
    """DecodingParams() with the family's settings, then the model's own overrides applied; a bad
    value is the file's fault, so the error names the file and its key (not a flag or config key
    nobody set)."""
    base = DecodingParams().with_overrides(**family_defaults(model_dir))
    try:
        return base.with_overrides(**read_defaults(model_dir))
    except InvalidParameter as error:
        raise CheckpointError(Path(model_dir) / DEFAULTS_FILE, str(error)) from None
    except TypeError as error:  # a value of the wrong type (a string for a number, ...)
        path = Path(model_dir) / DEFAULTS_FILE
        raise CheckpointError(path, f"a value has the wrong type: {error}") from None
