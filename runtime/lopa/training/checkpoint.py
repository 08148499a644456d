"""Writing a trained model in the real on-disk format (config.json, safetensors, tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from lopa.model.dream import DreamModel
from lopa.synthetic.tokenizer import write_char_tokenizer

TRAINING_FILE = "training.json"  # the recipe and the run's summary


def save_checkpoint(
    model: DreamModel, directory: str | Path, training: dict[str, Any] | None = None,
    chat_template: str | None = None,
) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.config.to_json(directory / "config.json")
    weights = {name: t.detach().contiguous().float() for name, t in model.state_dict().items()}
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    write_char_tokenizer(directory, chat_template)
    if training is not None:
        (directory / TRAINING_FILE).write_text(json.dumps(training, indent=2, sort_keys=True) + "\n")
    return directory
