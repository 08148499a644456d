"""load_model: config + safetensors (+ optional PEFT LoRA, merged) + tokenizer -> ready model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lopa.model.config import CONFIG_FILE, DreamConfig
from lopa.model.dream import DreamModel
from lopa.model.errors import CheckpointError
from lopa.model.lora import ADAPTER_WEIGHTS, merge_adapter, read_adapter
from lopa.model.tokenizer import load_tokenizer
from lopa.model.weight_formats import DTYPE, FP8, quantize_fp8, weights_problem
from lopa.model.weights import load_tensors
from lopa.model.window import DreamWindowModel

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_LM_HEAD = "lm_head.weight"
_EMBED = "model.embed_tokens.weight"
MASK_TOKEN = "<|mask|>"
GENERATION_CONFIG_FILE = "generation_config.json"


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}") from None


@dataclass(frozen=True)
class SpecialIds:
    mask: int
    eos: tuple[int, ...]  # any of these ends generation
    pad: int


@dataclass(frozen=True)
class LoadedModel:
    """What load_model returns; unpacks as `model, tokenizer, config = load_model(...)`."""

    model: DreamModel
    tokenizer: Any
    config: DreamConfig
    special: SpecialIds

    def __iter__(self) -> Iterator[Any]:
        return iter((self.model, self.tokenizer, self.config))

    @property
    def mask_token_id(self) -> int:
        return self.special.mask

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.special.eos

    def window_model(
        self, max_length: int, num_slots: int = 1, cuda_graphs: bool | None = None, max_batch: int = 1
    ) -> DreamWindowModel:
        """A WindowModel over this model with max_batch KV caches of max_length tokens each (CUDA
        graphs on CUDA unless cuda_graphs is False or LOPA_CUDA_GRAPHS=0)."""
        return DreamWindowModel(self.model, max_length, num_slots, cuda_graphs, max_batch)


def load_model(
    model_dir: str | Path,
    adapter_dir: str | Path | None = None,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    tokenizer_dir: str | Path | None = None,
    weights: str = DTYPE,
) -> LoadedModel:
    """Load a Dream checkpoint directory, merging a PEFT LoRA adapter if given; `weights` = "fp8"
    then quantizes its linear weights (lopa.model.weight_formats).

    Raises CheckpointError naming the missing or inconsistent file/field/tensor, ValueError naming
    `weights` when the device cannot run that format (before anything is read).
    """
    model_dir = Path(model_dir)
    torch_dtype, torch_device = parse_dtype(dtype), torch.device(device)
    problem = weights_problem(weights, torch_device)
    if problem:
        raise ValueError(f"weights: {problem}")
    config = DreamConfig.from_dir(model_dir)
    with torch.device("meta"):  # no memory, no random init: every parameter comes from the files
        model = DreamModel(config)
    expected = {name: param.shape for name, param in model.state_dict().items()}
    optional = frozenset({_LM_HEAD}) if config.tie_word_embeddings else frozenset()
    tensors = load_tensors(model_dir, expected, torch_device, torch_dtype, optional)
    if adapter_dir is not None:
        # merge_adapter adds B @ A in fp32 and rounds once to the model dtype.
        merge_adapter(tensors, read_adapter(adapter_dir), Path(adapter_dir) / ADAPTER_WEIGHTS)
    if _LM_HEAD not in tensors:
        tensors[_LM_HEAD] = tensors[_EMBED]  # tied embeddings
    model.load_state_dict(tensors, strict=True, assign=True)
    del tensors  # the fused projections below replace these storages: let them go
    model.eval().requires_grad_(False).fuse_projections()
    if weights == FP8:
        quantize_fp8(model)  # after the adapter's merge and the fusing: the merged weights are rounded
    tokenizer = load_tokenizer(tokenizer_dir or model_dir)
    return LoadedModel(model, tokenizer, config, resolve_special_ids(config, tokenizer, model_dir))


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
