"""Committed deltas for GenerateStream (pure): every D2F fill is final, so a step's delta never changes.

Text is emitted only up to what can no longer change: held back while it ends in an incomplete
character or could still be the start of a stop sequence; the last chunk flushes the rest so the
concatenated deltas equal the final text exactly. Token ids follow the text: the fewest ids that
cover the text sent so far, so no id past a stop sequence is ever streamed, and the streamed ids
concatenate to the unary response's ids (the last chunk carries the rest of them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from lopa.stops import first_stop


@dataclass
class DeltaTracker:
    decode: Callable[[list[int]], str]
    eos_ids: frozenset[int]
    stop: Sequence[str] = ()
    include_stop: bool = False  # the stop string is sent (the answer ends after it)
    offset: int = 0  # token ids already sent
    sent_text: str = ""
    _done: bool = field(default=False)

    def step(self, generated: list[int], mask_id: int) -> tuple[int, list[int], str]:
        """(offset, new token ids, text delta) after a step; generated = all positions."""
        end = generated.index(mask_id) if mask_id in generated else len(generated)
        contiguous = generated[:end]
        for index, token in enumerate(contiguous):
            if token in self.eos_ids:
                contiguous = contiguous[: index + 1]
                break
        if self._done:
            return self.offset, [], ""
        text = self._advance(self._stable(self.decode(contiguous)))
        # The fewest ids whose text covers the sent text: the final answer keeps at least these,
        # whatever the cut (a stop string is cut the same way: lopa.stops.cut_at_stop).
        count = self.offset
        while count < len(contiguous) and len(self.decode(contiguous[:count])) < len(self.sent_text):
            count += 1
        return self._ids(contiguous[:count], text)

    def finish(self, final_text: str, final_ids: list[int]) -> tuple[int, list[int], str]:
        """The rest of the final answer: (offset, ids, text), usually little or nothing; raises if the
        stream already went past it."""
        self._done = True
        if not final_text.startswith(self.sent_text) or len(final_ids) < self.offset:
            # Only possible when the final answer was cut inside what was already sent.
            raise AssertionError("the streamed answer is not a prefix of the final answer")
        return self._ids(final_ids, self._advance(final_text))

    def _ids(self, ids: list[int], text: str) -> tuple[int, list[int], str]:
        start, self.offset = self.offset, max(self.offset, len(ids))
        return start, ids[start:], text

    def _stable(self, text: str) -> str:
        if text.endswith("\ufffd"):
            text = text.rstrip("\ufffd")
        cut = first_stop(text, self.stop, self.include_stop)  # as the final answer is cut (cut_at_stop)
        if cut is not None:
            return text[:cut]
        hold = max((len(s) - 1 for s in self.stop), default=0)
        return text[: len(text) - hold] if hold else text

    def _advance(self, text: str) -> str:
        if not text.startswith(self.sent_text) or len(text) <= len(self.sent_text):
            return ""
        delta = text[len(self.sent_text) :]
        self.sent_text = text
        return delta
