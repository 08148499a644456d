"""load_model: config + safetensors (+ optional PEFT LoRA, merged) + tokenizer -> ready model."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lopa.model.config import ModelConfig
from lopa.model.families import family_named
from lopa.model.lora import ADAPTER_WEIGHTS, merge_adapter, read_adapter
from lopa.model.special_ids import SpecialIds, resolve_special_ids
from lopa.model.tokenizer import load_tokenizer
from lopa.model.transformer import DiffusionLM
from lopa.model.weight_formats import DTYPE, FP8, quantize_fp8, weights_problem
from lopa.model.weights import load_tensors
from lopa.model.window import WindowedLM

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


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}") from None


@dataclass(frozen=True)
class LoadedModel:
    """What load_model returns; unpacks as `model, tokenizer, config = load_model(...)`."""

    model: DiffusionLM
    tokenizer: Any
    config: ModelConfig
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
    ) -> WindowedLM:
        """A WindowModel over this model with max_batch KV caches of max_length tokens each (CUDA
        graphs on CUDA unless cuda_graphs is False or LOPA_CUDA_GRAPHS=0)."""
        return WindowedLM(self.model, max_length, num_slots, cuda_graphs, max_batch)


def load_model(
    model_dir: str | Path,
    adapter_dir: str | Path | None = None,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    tokenizer_dir: str | Path | None = None,
    weights: str = DTYPE,
) -> LoadedModel:
    """Load a checkpoint directory of any known family (lopa.model.families), merging a PEFT LoRA
    adapter if given; `weights` = "fp8" then quantizes its linear weights
    (lopa.model.weight_formats).

    Raises CheckpointError naming the missing or inconsistent file/field/tensor, ValueError naming
    `weights` when the device cannot run that format (before anything is read).
    """
    model_dir = Path(model_dir)
    torch_dtype, torch_device = parse_dtype(dtype), torch.device(device)
    problem = weights_problem(weights, torch_device)
    if problem:
        raise ValueError(f"weights: {problem}")
    config = ModelConfig.from_dir(model_dir)
    family = family_named(config.family)
    with torch.device("meta"):  # no memory, no random init: every parameter comes from the files
        model = DiffusionLM(config)
    expected = {name: param.shape for name, param in model.state_dict().items()}
    optional = frozenset({_LM_HEAD}) if config.tie_word_embeddings else frozenset()
    tensors = load_tensors(model_dir, expected, torch_device, torch_dtype, optional, family)
    if adapter_dir is not None:
        # merge_adapter adds B @ A in fp32 and rounds once to the model dtype.
        adapter = read_adapter(adapter_dir, family)
        merge_adapter(tensors, adapter, Path(adapter_dir) / ADAPTER_WEIGHTS, family)
    if _LM_HEAD not in tensors:
        tensors[_LM_HEAD] = tensors[_EMBED]  # tied embeddings
    model.load_state_dict(tensors, strict=True, assign=True)
    del tensors  # the fused projections below replace these storages: let them go
    model.eval().requires_grad_(False).fuse_projections()
    if weights == FP8:
        quantize_fp8(model)  # after the adapter's merge and the fusing: the merged weights are rounded
    tokenizer = load_tokenizer(tokenizer_dir or model_dir)
    return LoadedModel(model, tokenizer, config, resolve_special_ids(config, tokenizer, model_dir))
