"""A synthetic WindowModel: logits from a rule over the visible sequence, no weights.

It honours the protocol exactly (shared cached prefix, per-slot staging, commit),
so decoders and executors can be tested on models whose confidences are chosen
by hand. `rule(sequence, position)` returns the logits for `position` given the
tokens the model can see; the raw output at window index i is the rule for
position start + i + logit_shift (1: Dream's shift, the default; 0: LLaDA's own-position logits).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from lopa.model.protocol import WindowBatch, take_outputs

Rule = Callable[[Sequence[int], int], torch.Tensor]


class SyntheticModel:
    def __init__(
        self, vocab_size: int, max_length: int, rule: Rule, max_batch: int = 1, logit_shift: int = 1
    ) -> None:
        self.vocab_size = vocab_size
        self.logit_shift = logit_shift
        self.max_length = max_length
        self.max_batch = max_batch
        self.rule = rule
        self.caches: dict[int, list[int]] = {}
        self.staged: dict[tuple[int, int], list[int]] = {}  # (sequence, slot) -> tokens
        self.forward_calls = 0
        self.rows_seen: list[int] = []

    @property
    def cache(self) -> list[int]:
        return self.caches.setdefault(0, [])

    def reset(self, num_slots: int, sequence: int = 0) -> None:
        self.caches[sequence] = []
        self.staged = {key: value for key, value in self.staged.items() if key[0] != sequence}

    def cache_length(self, sequence: int = 0) -> int:
        return len(self.caches.setdefault(sequence, []))

    def forward(self, batch: WindowBatch) -> torch.Tensor:
        cache = self.caches.setdefault(batch.sequence, [])
        if batch.start != len(cache):
            raise AssertionError(f"window start {batch.start} != cache length {len(cache)}")
        self.forward_calls += 1
        self.rows_seen.append(batch.rows)
        out = torch.zeros((batch.rows, batch.tokens.shape[1], self.vocab_size))
        for row, length in enumerate(batch.lengths):
            window = batch.tokens[row, :length].tolist()
            sequence = cache + window
            for i in range(length):
                out[row, i] = self.rule(sequence, batch.start + i + self.logit_shift)
            self.staged[batch.sequence, batch.first_slot + row] = window[: batch.n_stage]
        return take_outputs(out, batch)

    def forward_many(self, batches: list[WindowBatch]) -> list[torch.Tensor]:
        return [self.forward(batch) for batch in batches]

    def commit(self, slot: int, n: int, sequence: int = 0) -> None:
        self.caches.setdefault(sequence, []).extend(self.staged[sequence, slot][:n])

    def copy_staged(self, source: int, target: int) -> None:
        for (sequence, slot), tokens in list(self.staged.items()):
            if sequence == source:
                self.staged[target, slot] = list(tokens)


def peaked(vocab_size: int, token: int, prob: float) -> torch.Tensor:
    """Logits of a distribution with `prob` on `token` and the rest spread evenly."""
    rest = (1.0 - prob) / (vocab_size - 1)
    probs = torch.full((vocab_size,), rest)
    probs[token] = prob
    return torch.log(probs)
