"""The local engine: tokenizer + model + Decoder over the batched local executor, on one device."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from lopa.decoding.decoder import Decoder, GenerationResult, StepEvent
from lopa.execution.local import LocalExecutor
from lopa.model.loader import LoadedModel, load_model
from lopa.model.tokenizer import chat_prompt_ids
from lopa.params import DecodingParams, InvalidParameter, check_length
from lopa.stops import cut_at_stop, stop_check

DEFAULT_MAX_LENGTH = 4096


def bundled_model_dir() -> Path:
    """The small D2F model shipped inside the package (the embedded default)."""
    return Path(__file__).resolve().parent / "bundled" / "model"


@dataclass
class Completion:
    text: str
    result: GenerationResult
    finish_reason: str  # "eos", "stop" or "length"


class LocalEngine:
    def __init__(
        self,
        loaded: LoadedModel,
        max_length: int | None = None,
        device: str = "cpu",
        model_dir: Path | None = None,
    ) -> None:
        self.loaded = loaded
        self.model_dir = model_dir
        self.tokenizer = loaded.tokenizer
        limit = loaded.config.max_position_embeddings
        self.max_length = min(max_length or DEFAULT_MAX_LENGTH, limit)
        self.window_model = loaded.window_model(self.max_length)
        self.decoder = Decoder(
            LocalExecutor(self.window_model, device=device, pad_id=loaded.special.pad),
            mask_id=loaded.special.mask,
            eos_ids=loaded.special.eos,
            max_length=self.max_length,
        )

    @classmethod
    def from_dirs(
        cls,
        model_dir: str | Path | None = None,
        adapter_dir: str | Path | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        max_length: int | None = None,
    ) -> LocalEngine:
        model_dir = Path(model_dir) if model_dir else bundled_model_dir()
        return cls(load_model(model_dir, adapter_dir, dtype, device), max_length, device, model_dir)

    def encode(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidParameter("prompt", "is empty")
            if chat:
                return chat_prompt_ids(self.tokenizer, prompt)
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        ids = [int(t) for t in prompt]
        vocab = self.loaded.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidParameter("prompt_token_ids", f"ids {bad[:5]} not in [0, {vocab})")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def generate(
        self,
        prompt: str | Sequence[int],
        params: DecodingParams,
        stop: Sequence[str] = (),
        on_step: Callable[[StepEvent], None] | None = None,
        chat: bool = False,
    ) -> Completion:
        ids = self.encode(prompt, chat)
        check_length(len(ids), params, self.decoder.max_length)
        should_stop = stop_check(self.decode, stop)
        result = self.decoder.generate(ids, params, on_step=on_step, should_stop=should_stop)
        cut = cut_at_stop(result, self.decode, stop)
        if cut is not None:
            return Completion(cut[0], cut[1], "stop")
        text = self.decode(result.output_ids)
        eos = bool(result.output_ids) and result.output_ids[-1] in self.loaded.special.eos
        return Completion(text, result, "eos" if eos else "length")
