"""The model a master serves, as its clients see it: name, tokenizer, length and usable limits."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lopa.bundled import bundled_llada_dir, bundled_model_dir
from lopa.model.config import ModelConfig
from lopa.model.special_ids import SpecialIds, resolve_special_ids
from lopa.model.tokenizer import load_tokenizer
from lopa.params import DecodingParams
from lopa.serving.shared.config import Limits, ServingConfig
from lopa.serving.shared.model_dir import usable_max_length


@dataclass(frozen=True)
class ServedModel:
    name: str  # the id clients name: the HTTP API's model
    path: Path
    config: ModelConfig
    tokenizer: Any
    special: SpecialIds
    max_length: int  # every request's KV cache: prompt + answer
    limits: Limits  # what a request can reach (usable_limits)
    defaults: DecodingParams  # the decoding of a request that overrides nothing
    workers: int
    backend: str
    max_token_chars: int = 1  # the most characters one token stands for (longest_token)

    @classmethod
    def load(cls, config: ServingConfig, path: Path) -> ServedModel:
        model_config = ModelConfig.from_dir(path)
        tokenizer = load_tokenizer(path)
        max_length = usable_max_length(config, path)
        return cls(
            name=served_model_name(config, path),
            path=path,
            config=model_config,
            tokenizer=tokenizer,
            special=resolve_special_ids(model_config, tokenizer, path),
            max_length=max_length,
            limits=usable_limits(config.limits, max_length),
            defaults=config.decoding,
            workers=config.workers.count,
            backend=config.workers.backend,
            max_token_chars=longest_token(tokenizer),
            aliases=config.master.model_aliases,
        )

    aliases: tuple[str, ...] = ()  # more ids a client may name it by (master.model_aliases)

    @property
    def names(self) -> tuple[str, ...]:
        """Every id the HTTP API answers to, the main one first."""
        return (self.name, *self.aliases)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def longest_token(tokenizer: Any) -> int:
    """The most characters one token stands for: its longest vocabulary entry, special tokens
    included (a byte-level entry has a character per byte, at least as many as the text it decodes
    to). A text of n characters is at least n / this many tokens, so its length bounds it before
    tokenizing."""
    return max(1, max((len(token) for token in tokenizer.get_vocab()), default=1))


def usable_limits(limits: Limits, max_length: int) -> Limits:
    """The limits a request can actually reach: no prompt or answer is longer than the KV cache."""
    return replace(
        limits,
        max_new_tokens=min(limits.max_new_tokens, max_length),
        max_prompt_tokens=min(limits.max_prompt_tokens, max_length),
    )


def served_model_name(config: ServingConfig, path: Path) -> str:
    """master.model_name, else the checkpoint directory's name ("lopa-bundled" for the bundled model,
    "lopa-bundled-llada" for its LLaDA-format sibling)."""
    if config.master.model_name:
        return config.master.model_name
    bundled = {bundled_model_dir(): "lopa-bundled", bundled_llada_dir(): "lopa-bundled-llada"}
    where = path.resolve()
    return next((name for directory, name in bundled.items() if directory.resolve() == where), path.name)
