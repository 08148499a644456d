"""An executor that answers with the task suite's exact posteriors instead of a model.

For a bundled task example it gives every masked position the distribution of the training data
given the tokens the branch shows: per group, the valid forms that agree with its visible
characters, weighted as the writer draws them (lopa.bundled.tasks); dots and the end are certain.
Run through the real Decoder it measures what the suite's structure allows, apart from how well a
model learned it (runtime/BENCHMARKS.md). Exact posteriors tie where a model's estimates differ a
little: equally deep positions of two words, for one, are ranked by position here.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

from lopa.bundled import tasks
from lopa.decoding.decoder import Decoder, GenerationResult
from lopa.decoding.executor import PartOutcome, VerifyPart
from lopa.decoding.rules import PositionStat
from lopa.params import DecodingParams
from lopa.scheduling.alone import decode_alone
from lopa.synthetic.tokenizer import special_token_id

Distribution = dict[int, float]


def char_id(ch: str) -> int:
    """The bundled tokenizer's id of a printable character (lopa.synthetic.tokenizer)."""
    return ord(ch) - 32


class PosteriorExecutor:
    """The Executor protocol (lopa.decoding.executor) for one example of the bundled task suite, one
    request at a time."""

    max_batch = 1
    executors = 1

    def __init__(self, example: tasks.Example, mask_id: int, eos_id: int) -> None:
        self.mask_id, self.eos_id = mask_id, eos_id
        self.prompt_length = len(example.prompt)
        given = example.answer.split(tasks.SEPARATOR)[1:-1]
        self.forms = [
            [([char_id(ch) for ch in form], tasks.KEEP_WEIGHT if c == 0 else 1)
             for c, form in enumerate(tasks.forms(example.task, group))]
            for group in given
        ]
        self.answer_length = len(example.answer)
        self.tokens: list[int] = []
        self.staged: list[list[int]] = []

    def ready(self) -> bool:
        return True

    def begin(self, params: DecodingParams, num_candidates: int, sequence: int = 0,
              excluded_ids: Collection[int] = (), alternatives: int = 0) -> None:
        self.tokens = []

    def verify_many(self, parts: Sequence[VerifyPart]) -> list[PartOutcome]:
        (part,) = parts  # its one request
        self.staged = [list(w.tokens[: part.n_stage]) for w in part.windows]
        return [[self._row(self.tokens[: part.start] + list(w.tokens), w.masked) for w in part.windows]]

    def commit_many(self, commits: Sequence[tuple[int, int]]) -> None:
        ((_, candidate),) = commits
        self.tokens += self.staged[candidate]

    def release(self, sequence: int) -> None:
        self.staged = []

    def _row(self, sequence: list[int], masked: Sequence[int]) -> list[PositionStat]:
        row = []
        for position in masked:
            dist = self.distribution(sequence, position - self.prompt_length)
            token = max(dist, key=lambda t: (dist[t], -t))  # ties: the lower id
            conf = sum(p * math.log(p + 1e-10) for p in dist.values())
            row.append(PositionStat(position, token, dist[token], conf))
        return row

    def distribution(self, sequence: list[int], offset: int) -> Distribution:
        """The posterior of generated position `offset` given the branch's visible tokens."""
        group, index = divmod(offset, tasks.GROUP_SIZE + 1)
        if offset >= self.answer_length:
            return {self.eos_id: 1.0}
        if index == 0 or group >= len(self.forms):
            return {char_id(tasks.SEPARATOR): 1.0}
        base = self.prompt_length + group * (tasks.GROUP_SIZE + 1) + 1
        shown = [sequence[base + i] if base + i < len(sequence) else self.mask_id
                 for i in range(tasks.GROUP_SIZE)]
        agree = [(form, weight) for form, weight in self.forms[group]
                 if all(s in (self.mask_id, f) for s, f in zip(shown, form, strict=True))]
        total = sum(weight for _, weight in agree)
        dist: Distribution = {}
        for form, weight in agree:
            dist[form[index - 1]] = dist.get(form[index - 1], 0.0) + weight / total
        return dist


def decode_exactly(example: tasks.Example, params: DecodingParams) -> tuple[GenerationResult, str]:
    """Decode one example with its exact posteriors through the real Decoder: (result, text)."""
    mask, eos = special_token_id("<|mask|>"), special_token_id("<|endoftext|>")
    executor = PosteriorExecutor(example, mask, eos)
    prompt = [char_id(ch) for ch in example.prompt]
    result = decode_alone(Decoder(executor, mask, [eos], max_length=256), prompt, params)
    text = "".join(chr(t + 32) for t in result.output_ids if t != eos)
    return result, text
