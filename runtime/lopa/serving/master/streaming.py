"""Committed deltas for GenerateStream (pure): every D2F fill is final, so a step's delta never changes.

Text is emitted only up to what can no longer change: held back while it ends in an incomplete
character or could still be the start of a stop sequence; the last chunk flushes the rest so the
concatenated deltas equal the final text exactly. Token ids follow the text: the fewest ids that
cover the text sent so far, so no id past a stop sequence is ever streamed, and the streamed ids
concatenate to the unary response's ids (the last chunk carries the rest of them).

A step costs what it added, not the answer's length: only the new contiguous ids are read, decoded
(lopa.detokenize) and searched for a stop (lopa.stops.StopSearch), so a long stream does not slow
the scheduler thread that runs every request's round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lopa.detokenize import Decode, IncrementalText
from lopa.stops import StopPolicy, StopSearch


@dataclass
class DeltaTracker:
    decode: Decode
    eos_ids: frozenset[int]  # every token that ends the answer (StopPolicy.end_ids)
    stop: StopPolicy = field(default_factory=StopPolicy)
    begin: int = 0  # the answer's first position in the steps' sequences
    end: int | None = None  # past the answer's last position (None: the sequence's end)
    offset: int = 0  # token ids already sent
    sent: int = 0  # characters already sent
    _text: IncrementalText = field(init=False)
    _stops: StopSearch = field(init=False)
    _ended: bool = field(default=False, init=False)  # an end id was read: nothing after it counts
    _done: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self._text = IncrementalText(self.decode)
        self._stops = self.stop.search()

    @property
    def sent_text(self) -> str:
        return self._text.text[: self.sent]

    def step(self, sequence: Sequence[int], mask_id: int) -> tuple[int, list[int], str]:
        """(offset, new token ids, text delta) after a step; sequence = every position of the step."""
        if self._done:
            return self.offset, [], ""
        self._text.extend(self._new_ids(sequence, mask_id))
        text = self._advance()
        # The fewest ids whose text covers the sent text: the final answer keeps at least these,
        # whatever the cut (a stop string is cut the same way: lopa.stops.cut_at_stop).
        return self._ids(self._text.ids, self._text.covering(self.sent), text)

    def finish(self, final_text: str, final_ids: list[int]) -> tuple[int, list[int], str]:
        """The rest of the final answer: (offset, ids, text), usually little or nothing; raises if the
        stream already went past it."""
        self._done = True
        if not final_text.startswith(self.sent_text) or len(final_ids) < self.offset:
            # Only possible when the final answer was cut inside what was already sent.
            raise AssertionError("the streamed answer is not a prefix of the final answer")
        text, self.sent = final_text[self.sent :], len(final_text)
        return self._ids(final_ids, len(final_ids), text)

    def _new_ids(self, sequence: Sequence[int], mask_id: int) -> list[int]:
        """The contiguous ids not read yet: up to the first mask, through the first end id."""
        new: list[int] = []
        end = len(sequence) if self.end is None else min(self.end, len(sequence))
        position = self.begin + len(self._text.ids)
        while not self._ended and position < end and sequence[position] != mask_id:
            new.append(sequence[position])
            self._ended = sequence[position] in self.eos_ids
            position += 1
        return new

    def _advance(self) -> str:
        """The text that can no longer change and was not sent yet (marked sent)."""
        self._stops.find(self._text)
        until = self._stops.sendable(len(self._text))
        if until <= self.sent:
            return ""
        delta = self._text.tail(self.sent)[: until - self.sent]
        self.sent = until
        return delta

    def _ids(self, ids: list[int], count: int, text: str) -> tuple[int, list[int], str]:
        start, self.offset = self.offset, max(self.offset, count)
        return start, ids[start : self.offset], text
