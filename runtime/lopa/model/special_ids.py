"""The special token ids (mask, end, pad) of a checkpoint, from its config files and tokenizer.

No torch here: the master resolves them from the tokenizer alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lopa.model.config import CONFIG_FILE, DreamConfig
from lopa.model.errors import CheckpointError

MASK_TOKEN = "<|mask|>"
GENERATION_CONFIG_FILE = "generation_config.json"


@dataclass(frozen=True)
class SpecialIds:
    mask: int
    eos: tuple[int, ...]  # any of these ends generation
    pad: int


def resolve_special_ids(config: DreamConfig, tokenizer: Any, model_dir: str | Path = ".") -> SpecialIds:
    """Mask/eos/pad ids: from config.json first, else from the tokenizer; never hard-coded.

    The eos ids are those of config.json plus those of generation_config.json (instruct models
    may list their end-of-turn token there).
    """
    mask = config.mask_token_id
    if mask is None:
        mask = getattr(tokenizer, "mask_token_id", None)
    if mask is None:
        token_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
        if isinstance(token_id, int) and token_id != getattr(tokenizer, "unk_token_id", None):
            mask = token_id
    if mask is None:
        raise CheckpointError(Path(model_dir) / CONFIG_FILE, f"no mask_token_id and no {MASK_TOKEN} token")
    eos = tuple(dict.fromkeys(config.eos_token_ids + _generation_eos_ids(Path(model_dir))))
    if not eos and tokenizer.eos_token_id is not None:
        eos = (int(tokenizer.eos_token_id),)
    if not eos:
        raise CheckpointError(Path(model_dir) / CONFIG_FILE, "no eos_token_id in the config or the tokenizer")
    pad = config.pad_token_id
    if pad is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    return SpecialIds(mask=int(mask), eos=tuple(eos), pad=int(pad))


def _generation_eos_ids(model_dir: Path) -> tuple[int, ...]:
    path = model_dir / GENERATION_CONFIG_FILE
    if not path.is_file():
        return ()
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
        raise CheckpointError(path, f"not a valid JSON object: {exc}") from None
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise CheckpointError(path, f"eos_token_id must be an integer or a list of them, got {value!r}")
    return tuple(values)
