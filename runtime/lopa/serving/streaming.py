"""Committed deltas for GenerateStream (pure): every D2F fill is final, so a step's delta never changes.

Text is emitted only up to what can no longer change: held back while it ends in an incomplete
character or could still be the start of a stop sequence; the last chunk flushes the rest so the
concatenated deltas equal the final text exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class DeltaTracker:
    decode: Callable[[list[int]], str]
    eos_ids: frozenset[int]
    stop: Sequence[str] = ()
    offset: int = 0  # generated tokens already sent
    sent_text: str = ""
    _done: bool = field(default=False)

    def step(self, generated: list[int], mask_id: int) -> tuple[int, list[int], str]:
        """(offset, new contiguous token ids, text delta) after a step; generated = all positions."""
        end = generated.index(mask_id) if mask_id in generated else len(generated)
        contiguous = generated[:end]
        for index, token in enumerate(contiguous):
            if token in self.eos_ids:
                contiguous = contiguous[: index + 1]
                break
        start = self.offset
        new_ids = contiguous[start:] if not self._done else []
        self.offset = max(self.offset, len(contiguous))
        text = self._stable(self.decode(contiguous))
        return start, new_ids, self._advance(text)

    def finish(self, final_text: str) -> str:
        """The rest of the final text (usually empty); raises if the stream already went past it."""
        self._done = True
        if not final_text.startswith(self.sent_text):
            # Only possible when the final text was cut inside what was already sent.
            raise AssertionError("streamed text is not a prefix of the final text")
        return self._advance(final_text)

    def _stable(self, text: str) -> str:
        if text.endswith("\ufffd"):
            text = text.rstrip("\ufffd")
        for s in self.stop:
            cut = text.find(s)
            if cut >= 0:
                return text[:cut]
        hold = max((len(s) - 1 for s in self.stop), default=0)
        return text[: len(text) - hold] if hold else text

    def _advance(self, text: str) -> str:
        if not text.startswith(self.sent_text) or len(text) <= len(self.sent_text):
            return ""
        delta = text[len(self.sent_text) :]
        self.sent_text = text
        return delta
