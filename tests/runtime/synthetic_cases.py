"""Shared helpers for the decoder tests: synthetic rules, observers and runners.

Nothing here re-implements the code under test: the helpers build SyntheticModel
rules from small tables, record what the real executor/model were asked to do,
and run the real Decoder.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lopa.decoding.decoder import Decoder, GenerationResult, StepEvent
from lopa.decoding.executor import BranchWindow, PartOutcome, VerifyPart
from lopa.decoding.rules import PositionStat
from lopa.execution.local import LocalExecutor
from lopa.model.protocol import WindowBatch, WindowModel
from lopa.params import DecodingParams
from lopa.scheduling.alone import decode_alone
from tests.helpers.rule_model import Rule, SyntheticModel, peaked

VOCAB = 20
MASK = 19
EOS = 18
MAX_LENGTH = 128


# (token, prob) for a position given the visible sequence, or None for "don't care" (uniform).
Choice = Callable[[Sequence[int], int], "tuple[int, float] | None"]


def rule_from(choice: Choice, vocab: int = VOCAB) -> Rule:
    """A SyntheticModel rule from a (sequence, position) -> (token, prob) | None function.

    The rule is also asked about positions that are already filled and about the
    position just past the end of the sequence; `choice` only has to answer for
    the positions it cares about (anything else is uniform).
    """

    def rule(sequence: Sequence[int], position: int) -> torch.Tensor:
        picked = choice(sequence, position) if position < len(sequence) else None
        if picked is None:
            return torch.zeros(vocab)
        return peaked(vocab, picked[0], picked[1])

    return rule


def filled(sequence: Sequence[int], position: int) -> bool:
    return position < len(sequence) and sequence[position] != MASK


def hash_choice(
    prompt_length: int, eos_at: int | None = None, eos_prob: float = 0.95, vocab: int = VOCAB
) -> Choice:
    """A context-dependent pseudo-random model: the token and P of position p depend on (p, the
    three tokens left of p, masks included), so the filling order changes later distributions.

    P is drawn from a coarse grid (0.05 steps, never within 0.02 of a threshold used by the
    tests) so that float rounding cannot flip a threshold decision. Tokens avoid MASK and EOS;
    generated position `eos_at` (relative to the prompt end) always predicts EOS, with
    `eos_prob` once its left neighbour is filled and 0.55 before.
    """
    grid = [0.32, 0.37, 0.42, 0.47, 0.52, 0.57, 0.62, 0.67, 0.72, 0.77, 0.83, 0.87, 0.93, 0.97, 0.99]

    def choice(sequence: Sequence[int], position: int) -> tuple[int, float] | None:
        if position < prompt_length:
            return None
        if eos_at is not None and position == prompt_length + eos_at:
            return EOS, (eos_prob if filled(sequence, position - 1) else 0.55)
        context = [position, *sequence[max(0, position - 3) : position]]
        h = zlib.crc32(bytes(x % 256 for x in context))
        token = h % (vocab - 2)  # never MASK (vocab-1) nor EOS (vocab-2)
        return token, grid[(h >> 8) % len(grid)]

    return choice


def synthetic_model(
    choice: Choice, vocab: int = VOCAB, max_length: int = MAX_LENGTH, logit_shift: int = 1
) -> SyntheticModel:
    return SyntheticModel(vocab, max_length, rule_from(choice, vocab), logit_shift=logit_shift)


@dataclass
class VerifyCall:
    start: int
    n_stage: int
    windows: list[BranchWindow]
    stats: list[list[PositionStat]]
    committed: int | None = None


class RecordingExecutor(LocalExecutor):
    """The real LocalExecutor, plus a log of every verify/commit it served (observation only)."""

    def __init__(self, model: WindowModel) -> None:
        super().__init__(model)
        self.calls: list[VerifyCall] = []

    def begin(self, params: DecodingParams, num_candidates: int, sequence: int = 0, *rest: Any) -> None:
        super().begin(params, num_candidates, sequence, *rest)
        self.calls = []

    def verify_many(self, parts: Sequence[VerifyPart]) -> list[PartOutcome]:
        outcomes = super().verify_many(parts)
        for part, stats in zip(parts, outcomes, strict=True):
            self.calls.append(VerifyCall(part.start, part.n_stage, list(part.windows), stats))
        return outcomes

    def commit_many(self, commits: Sequence[tuple[int, int]]) -> None:
        super().commit_many(commits)
        for _, candidate in commits:
            self.calls[-1].committed = candidate


@dataclass
class RecordingModel:
    """A WindowModel wrapper that records the shape of every forward, then delegates."""

    inner: WindowModel
    lengths: list[list[int]] = field(default_factory=list)
    n_stage: list[int] = field(default_factory=list)

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def logit_shift(self) -> int:
        return self.inner.logit_shift

    @property
    def max_length(self) -> int:
        return self.inner.max_length

    @property
    def max_batch(self) -> int:
        return self.inner.max_batch

    def reset(self, num_slots: int, sequence: int = 0) -> None:
        self.inner.reset(num_slots, sequence)

    def cache_length(self, sequence: int = 0) -> int:
        return self.inner.cache_length(sequence)

    def forward(self, batch: WindowBatch) -> torch.Tensor:
        self.lengths.append(list(batch.lengths))
        self.n_stage.append(batch.n_stage)
        return self.inner.forward(batch)

    def forward_many(self, batches: list[WindowBatch]) -> list[torch.Tensor]:
        for batch in batches:
            self.lengths.append(list(batch.lengths))
            self.n_stage.append(batch.n_stage)
        return self.inner.forward_many(batches)

    def commit(self, slot: int, n: int, sequence: int = 0) -> None:
        self.inner.commit(slot, n, sequence)

    def copy_staged(self, source: int, target: int) -> None:
        self.inner.copy_staged(source, target)


def generate(
    model: WindowModel,
    prompt: Sequence[int],
    params: DecodingParams,
    executor: LocalExecutor | None = None,
    mask_id: int = MASK,
    eos_ids: Sequence[int] = (EOS,),
    max_length: int = MAX_LENGTH,
) -> tuple[GenerationResult, list[StepEvent]]:
    """Run the real Decoder over a LocalExecutor; return the result and every StepEvent."""
    events: list[StepEvent] = []
    decoder = Decoder(executor or LocalExecutor(model), mask_id, eos_ids, max_length)
    result = decode_alone(decoder, prompt, params, on_step=events.append)
    return result, events
