"""One request at a time through the real Decoder and LocalExecutor, for the paper's checks.

The checks steer or observe a round from outside the rules: an `ExecutorProxy` sits between the
Decoder and the LocalExecutor and may rewrite a round's statistics or record its winner, so every
variant runs the production round (lopa.decoding.generation) unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lopa.bundled.tasks import Example, score
from lopa.decoding.decoder import Decoder, GenerationResult, StepEvent
from lopa.decoding.executor import BranchWindow, Executor, PartOutcome, VerifyPart, verify_part
from lopa.decoding.rules import PositionStat
from lopa.execution.local import LocalExecutor
from lopa.model.loader import LoadedModel, load_model
from lopa.params import DecodingParams
from lopa.scheduling.alone import decode_alone

Stats = list[list[PositionStat]]


class ExecutorProxy:
    """An Executor that hands every call to `inner`, for one request at a time (the Decoder's): a
    check overrides `verify` or `commit`, the lone round's two steps, to steer or observe them."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.max_batch, self.executors = 1, inner.executors
        self._sequence = 0

    def ready(self) -> bool:
        return self.inner.ready()

    def begin(self, params: DecodingParams, num_candidates: int, sequence: int = 0,
              excluded_ids: Collection[int] = (), alternatives: int = 0) -> None:
        self._sequence = sequence
        self.inner.begin(params, num_candidates, sequence, excluded_ids, alternatives)

    def verify_many(self, parts: Sequence[VerifyPart]) -> list[PartOutcome]:
        (part,) = parts
        return [self.verify(part.start, part.n_stage, part.windows)]

    def commit_many(self, commits: Sequence[tuple[int, int]]) -> None:
        ((_, candidate),) = commits
        self.commit(candidate)

    def release(self, sequence: int) -> None:
        self.inner.release(sequence)

    def verify(self, start: int, n_stage: int, windows: Sequence[BranchWindow]) -> Stats:
        return verify_part(self.inner, VerifyPart(self._sequence, start, n_stage, windows))

    def commit(self, candidate: int) -> None:
        self.inner.commit_many([(self._sequence, candidate)])


@dataclass
class SingleModel:
    """A checkpoint with one KV cache: decodes one request at a time, no scheduler thread."""

    loaded: LoadedModel
    executor: LocalExecutor
    max_length: int

    @classmethod
    def load(cls, model_dir: str | Path) -> SingleModel:
        loaded = load_model(model_dir)
        max_length = loaded.config.max_position_embeddings
        window = loaded.window_model(max_length, max_batch=1)
        return cls(loaded, LocalExecutor(window, pad_id=loaded.special.pad), max_length)

    def encode(self, text: str) -> list[int]:
        return list(self.loaded.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.loaded.tokenizer.decode(list(ids), skip_special_tokens=True)

    def generate(
        self,
        prompt: Sequence[int],
        params: DecodingParams,
        proxy: Callable[[Executor], Executor] | None = None,
        on_step: Callable[[StepEvent], None] | None = None,
    ) -> GenerationResult:
        executor: Executor = proxy(self.executor) if proxy else self.executor
        special = self.loaded.special
        decoder = Decoder(executor, special.mask, special.eos, self.max_length)
        return decode_alone(decoder, prompt, params, on_step)


@dataclass
class Tally:
    """Exact match and counts over a set of decodes (ratios over the set, as lopa bench tpf)."""

    examples: int = 0
    correct: int = 0
    tokens: int = 0
    forwards: int = 0
    verified: int = 0

    def add(self, example: Example, text: str, result: GenerationResult) -> None:
        self.examples += 1
        self.correct += score(example, text)
        self.tokens += result.tokens
        self.forwards += result.forwards
        self.verified += result.verified_tokens

    @property
    def tpf(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0

    def row(self) -> dict[str, Any]:
        return {
            "exact_match_pct": round(100 * self.correct / self.examples, 1) if self.examples else 0.0,
            "tpf": round(self.tpf, 3),
            "forwards": self.forwards,
            "tokens": self.tokens,
            "verified_per_token": round(self.verified / self.tokens, 2) if self.tokens else 0.0,
        }
