"""Decode task examples with one parameter setting and aggregate accuracy and speed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from lopa.bundled.tasks import Example, score
from lopa.engine import LocalEngine
from lopa.params import DecodingParams


@dataclass(frozen=True)
class RunStats:
    """One (attention, k) cell. Ratios are over the whole set (sum of tokens / sum of forwards)."""

    attention: str
    branches: int
    examples: int
    exact_match: float  # fraction in [0, 1]
    tokens: int  # up to and including the first EOS
    generated_positions: int  # every generated position (post-EOS padding included)
    forwards: int
    wall_s: float  # generation wall time, prefill included
    by_task: dict[str, float]  # exact match per task

    @property
    def tpf(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0

    @property
    def padded_tpf(self) -> float:
        """The authors' count: all generated positions over (forwards + 1) per request."""
        return self.generated_positions / (self.forwards + self.examples) if self.forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def step_ms(self) -> float:
        return 1000.0 * self.wall_s / self.forwards if self.forwards else 0.0

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out.update(
            tpf=self.tpf, padded_tpf=self.padded_tpf, tokens_per_s=self.tokens_per_s, step_ms=self.step_ms
        )
        return out


def evaluate(engine: LocalEngine, examples: Sequence[Example], params: DecodingParams) -> RunStats:
    correct: dict[str, list[bool]] = {}
    tokens = positions = forwards = 0
    wall = 0.0
    for example in examples:
        completion = engine.generate(example.prompt, params)
        result = completion.result
        correct.setdefault(example.task, []).append(score(example, completion.text))
        tokens += result.tokens
        positions += len(result.generated_ids)
        forwards += result.forwards
        wall += result.wall_s
    hits = [hit for per_task in correct.values() for hit in per_task]
    return RunStats(
        attention=params.attention.value,
        branches=params.branches,
        examples=len(examples),
        exact_match=sum(hits) / len(hits) if hits else 0.0,
        tokens=tokens,
        generated_positions=positions,
        forwards=forwards,
        wall_s=wall,
        by_task={task: sum(v) / len(v) for task, v in sorted(correct.items())},
    )
