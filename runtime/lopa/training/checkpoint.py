"""Writing a trained model in its family's on-disk format (config.json, safetensors, tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from lopa.model.families import family_named
from lopa.model.transformer import DiffusionLM
from lopa.synthetic.tokenizer import write_char_tokenizer

TRAINING_FILE = "training.json"  # the recipe and the run's summary


def save_checkpoint(
    model: DiffusionLM, directory: str | Path, training: dict[str, Any] | None = None,
    chat_template: str | None = None,
) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.config.to_json(directory / "config.json")  # in the family's keys, its tensors in its names
    family = family_named(model.config.family)
    weights = {
        family.checkpoint_name(name): value.detach().contiguous().float()
        for name, value in model.state_dict().items()
    }
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    write_char_tokenizer(directory, chat_template)
    if training is not None:
        (directory / TRAINING_FILE).write_text(json.dumps(training, indent=2, sort_keys=True) + "\n")
    return directory
