"""Model families: what differs between the checkpoints lopa serves, said once per family.

A family is recognised by config.json's `model_type` (or, without one, its `architectures`) and
says how its config.json reads into lopa's ModelConfig and back, what its tensors and modules are
called (the loader, the LoRA merge and the checkpoint writers translate through it), whether a
position's logits are its own or its predecessor's (the logit shift the executors apply), its
special tokens, and the D2F decoding settings its authors evaluate with. Everything after loading
(the window forward, the KV cache, CUDA graphs, FP8 weights, kernels, batching, branch workers,
the commit) is the same for every family.

    dream   Dream-v0-Base/Instruct-7B, DiffuCoder-7B and their D2F LoRAs (families/dream.py)
    llada   LLaDA-8B-Base/Instruct and its D2F LoRA (families/llada.py)

No torch here: the master reads configs and special ids without it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lopa.model.config import CONFIG_FILE, ModelConfig
from lopa.model.errors import CheckpointError

LAYER = "{i}"  # a layer index in a module name pattern


@dataclass(frozen=True)
class Family:
    """One checkpoint format (see the module docstring)."""

    name: str
    model_types: tuple[str, ...]  # config.json model_type values
    architectures: tuple[str, ...]  # config.json architectures entries
    logit_shift: int  # 1: the output at position i predicts token i + 1; 0: token i
    read: Callable[[Mapping[str, Any], Path], ModelConfig]  # config.json -> ModelConfig (unvalidated)
    write: Callable[[ModelConfig], dict[str, Any]]  # ModelConfig -> config.json
    # lopa's module name -> the checkpoint's (LAYER for the layer index); empty: the same names.
    modules: tuple[tuple[str, str], ...] = ()
    config_keys: Mapping[str, str] = field(default_factory=dict)  # lopa's field -> config.json key
    mask_tokens: tuple[str, ...] = ()  # the mask token's text, when config.json has no mask_token_id
    end_of_turn_tokens: tuple[str, ...] = ()  # end a chat answer, where the chat template uses them
    decoding_defaults: Mapping[str, Any] = field(default_factory=dict)  # the authors' D2F settings
    d2f_lora_targets: tuple[str, ...] = ()  # the published D2F LoRA's target_modules

    def config_dict(self, config: ModelConfig) -> dict[str, Any]:
        return self.write(config)

    def checkpoint_name(self, name: str) -> str:
        """lopa's name of a tensor or module -> the checkpoint's."""
        if not self.modules:
            return name
        translated = _translate(name, self._to_checkpoint)
        if translated is None:
            raise KeyError(f"{name} is not a module of lopa's model")
        return translated

    def lopa_name(self, name: str) -> str | None:
        """The checkpoint's name of a tensor or module -> lopa's (None: not one of this family's)."""
        if not self.modules:
            return name
        return _translate(name, self._to_lopa)

    @property
    def _to_checkpoint(self) -> tuple[tuple[re.Pattern[str], str], ...]:
        return _patterns(self.modules)

    @property
    def _to_lopa(self) -> tuple[tuple[re.Pattern[str], str], ...]:
        return _patterns(tuple((theirs, ours) for ours, theirs in self.modules))


@functools.lru_cache(maxsize=16)
def _patterns(pairs: tuple[tuple[str, str], ...]) -> tuple[tuple[re.Pattern[str], str], ...]:
    # "a.{i}.b" matches "a.3.b" and the names under it ("a.3.b.weight", "a.3.b.lora_A.weight").
    compiled = []
    for source, target in pairs:
        pattern = re.escape(source).replace(re.escape(LAYER), r"(?P<i>\d+)")
        compiled.append((re.compile(rf"^{pattern}(?P<rest>(\..+)?)$"), target))
    return tuple(compiled)


def _translate(name: str, patterns: tuple[tuple[re.Pattern[str], str], ...]) -> Any:
    if not patterns:
        return name
    for pattern, target in patterns:
        match = pattern.match(name)
        if match:
            layer = match.groupdict().get("i")
            return target.replace(LAYER, layer or "") + match["rest"]
    return None


def _families() -> tuple[Family, ...]:
    from lopa.model.families import dream, llada

    return (dream.FAMILY, llada.FAMILY)


def known() -> str:
    """The families and the model_type each is recognised by, for error messages."""
    return ", ".join(f"{f.name} (model_type {' / '.join(f.model_types)})" for f in _families())


def family_named(name: str) -> Family:
    for family in _families():
        if family.name == name:
            return family
    raise ValueError(f"unknown model family {name!r}; lopa knows {known()}")


def family_of(raw: Mapping[str, Any], path: str | Path = CONFIG_FILE) -> Family:
    """The family of a config.json mapping, from its model_type, else its architectures."""
    model_type = raw.get("model_type")
    architectures = raw.get("architectures") or []
    for family in _families():
        if model_type is not None:
            if isinstance(model_type, str) and model_type.lower() in (t.lower() for t in family.model_types):
                return family
        elif isinstance(architectures, list) and set(architectures) & set(family.architectures):
            return family
    if model_type is None:
        raise CheckpointError(
            path,
            f"no model_type (nor a known architectures entry, got {architectures!r}); lopa knows {known()}",
        )
    raise CheckpointError(path, f"model_type {model_type!r} is not a family lopa knows; it knows {known()}")


def parse_config(raw: Mapping[str, Any], path: str | Path = CONFIG_FILE) -> ModelConfig:
    """config.json of any known family -> a validated ModelConfig."""
    path = Path(path)
    family = family_of(raw, path)
    config = family.read(raw, path)
    config.validate(path, family.config_keys)
    return config
