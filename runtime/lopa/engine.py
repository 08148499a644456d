"""The local engine: tokenizer + model + the request scheduler over the local executor, on one device.

Requests from any number of threads are batched: every running request advances one round per
ragged forward (lopa.scheduling). On CPU a request's output is bit-identical whatever runs beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from lopa.bundled import bundled_model_dir
from lopa.decoding.decoder import Decoder, StepEvent
from lopa.execution.local import LocalExecutor
from lopa.host.openmp import release_thread_pool
from lopa.model.decoding_defaults import model_defaults
from lopa.model.loader import LoadedModel, load_model
from lopa.model.tokenizer import chat_prompt_ids
from lopa.params import DecodingParams, InvalidParameter, check_length
from lopa.scheduling.budget import configured_budget
from lopa.scheduling.calibration import measured_tokens
from lopa.scheduling.limits import Limits
from lopa.scheduling.request import Completion, Request, Waiter
from lopa.scheduling.scheduler import Observer, Scheduler
from lopa.scheduling.warmup import warm_graphs
from lopa.stops import StopPolicy

DEFAULTS = Limits()  # a served group's defaults (the config file's limits section)

__all__ = ["Completion", "LocalEngine", "bundled_model_dir"]


class LocalEngine:
    def __init__(
        self,
        loaded: LoadedModel,
        max_length: int | None = None,
        device: str = "cpu",
        model_dir: Path | None = None,
        max_batch: int = DEFAULTS.max_batch,
        max_step_tokens: int | None = None,
        observer: Observer | None = None,
        warm: DecodingParams | None = None,
    ) -> None:
        """warm: the decoding settings whose likely rounds' CUDA graphs are captured before the
        first request (lopa.scheduling.warmup; several requests at once only); default: the model
        directory's defaults."""
        self.loaded = loaded
        self.model_dir = model_dir
        self.tokenizer = loaded.tokenizer
        limit = loaded.config.max_position_embeddings
        self.max_length = min(max_length or DEFAULTS.max_length, limit)
        self.window_model = loaded.window_model(self.max_length, max_batch=max_batch)
        self.executor = LocalExecutor(self.window_model, device=device, pad_id=loaded.special.pad)
        self.decoder = Decoder(
            self.executor, mask_id=loaded.special.mask, eos_ids=loaded.special.eos, max_length=self.max_length
        )
        # 0 or None: the device's default, as limits.max_step_tokens = 0 is for a served group: on an
        # accelerator measured on this model now (lopa.scheduling.calibration), unless one request at
        # a time runs (a lone request is never cut: nothing to measure for)
        if not max_step_tokens and max_batch > 1:
            max_step_tokens = measured_tokens(self.window_model, str(device))
        budget = configured_budget(max_step_tokens or 0, str(device))
        if max_batch > 1:
            params = warm or (model_defaults(model_dir) if model_dir is not None else DecodingParams())
            warm_graphs(self.window_model, params, budget.tokens or None)
        self.scheduler = Scheduler(
            self.decoder, self.executor, self.decode, DEFAULTS.queue_size, budget, observer
        )
        # Forwards run on the scheduler thread: this thread's OpenMP pool (from loading the model)
        # would otherwise slow every op there (lopa.host.openmp).
        release_thread_pool()

    @classmethod
    def from_dirs(
        cls,
        model_dir: str | Path | None = None,
        adapter_dir: str | Path | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        max_length: int | None = None,
        max_batch: int = DEFAULTS.max_batch,
        max_step_tokens: int | None = None,
        weights: str = "dtype",
        warm: DecodingParams | None = None,
    ) -> LocalEngine:
        """weights: the linear weights' format, "dtype" or "fp8" (lopa.model.weight_formats)."""
        model_dir = Path(model_dir) if model_dir else bundled_model_dir()
        loaded = load_model(model_dir, adapter_dir, dtype, device, weights=weights)
        return cls(loaded, max_length, device, model_dir, max_batch, max_step_tokens, warm=warm)

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
        pin_branches: bool = False,
        ignore_eos: bool = False,
        top_logprobs: int = 0,
    ) -> Completion:
        """Decode one prompt; safe to call from many threads at once (their rounds are batched).
        on_step runs on the scheduler thread; top_logprobs: each answer token's most probable
        alternatives kept (GenerationResult.output_alternatives)."""
        ids = self.encode(prompt, chat)
        check_length(len(ids), params, self.decoder.max_length)
        waiter = Waiter()
        request = Request(ids, params, StopPolicy(tuple(stop)), pin_branches, ignore_eos, top_logprobs,
                          on_step=on_step, on_done=waiter)
        self.scheduler.submit(request)
        self.scheduler.start()
        # This thread only waits now: a pool from any torch op it ran would slow the scheduler's.
        release_thread_pool()
        return waiter.wait()

    def close(self) -> None:
        """Stop the scheduler thread: requests still running or queued fail, and later ones are
        refused (SchedulerStopped)."""
        self.scheduler.stop()
