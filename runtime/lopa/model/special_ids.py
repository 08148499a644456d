"""The special token ids (mask, end, pad) of a checkpoint, from its config files and tokenizer.

No torch here: the master resolves them from the tokenizer alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lopa.model.config import CONFIG_FILE, ModelConfig
from lopa.model.errors import CheckpointError
from lopa.model.families import family_named

GENERATION_CONFIG_FILE = "generation_config.json"


@dataclass(frozen=True)
class SpecialIds:
    mask: int
    eos: tuple[int, ...]  # any of these ends generation
    pad: int


def resolve_special_ids(config: ModelConfig, tokenizer: Any, model_dir: str | Path = ".") -> SpecialIds:
    """Mask/eos/pad ids: from config.json first, else from the tokenizer; never hard-coded.

    The eos ids are those of config.json plus those of generation_config.json (instruct models
    may list their end-of-turn token there), plus the family's end-of-turn token where the
    checkpoint's chat template writes it (`<|im_end|>` for Dream-Instruct, `<|eot_id|>` for
    LLaDA-Instruct): a chat answer ends where the template closes a turn.
    """
    family = family_named(config.family)
    mask = config.mask_token_id
    if mask is None:
        mask = getattr(tokenizer, "mask_token_id", None)
    for token in family.mask_tokens if mask is None else ():
        mask = _token_id(tokenizer, token)
        if mask is not None:
            break
    if mask is None:
        tokens = " or ".join(family.mask_tokens) or "mask"
        raise CheckpointError(Path(model_dir) / CONFIG_FILE, f"no mask_token_id and no {tokens} token")
    turn_ends = tuple(
        token_id
        for token in family.end_of_turn_tokens
        if token in _chat_template(tokenizer) and (token_id := _token_id(tokenizer, token)) is not None
    )
    eos = tuple(dict.fromkeys(config.eos_token_ids + _generation_eos_ids(Path(model_dir)) + turn_ends))
    if not eos and tokenizer.eos_token_id is not None:
        eos = (int(tokenizer.eos_token_id),)
    if not eos:
        raise CheckpointError(Path(model_dir) / CONFIG_FILE, "no eos_token_id in the config or the tokenizer")
    pad = config.pad_token_id
    if pad is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    return SpecialIds(mask=int(mask), eos=tuple(eos), pad=int(pad))


def _token_id(tokenizer: Any, token: str) -> int | None:
    """The id of a token the tokenizer has (None where it maps it to unk or lacks it)."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    if isinstance(token_id, int) and token_id != getattr(tokenizer, "unk_token_id", None):
        return token_id
    return None


def _chat_template(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: any of them may close a turn
        return "".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


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
