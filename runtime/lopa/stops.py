"""Stop strings (pure): when decoding may stop, and where the answer is cut.

An answer cut at a stop string keeps only the tokens that produced the kept text, so token ids,
token counts, TPF and tokens/s describe what the caller receives, not what was decoded past it.
A growing answer is searched only where it grew (StopSearch over lopa.detokenize's incremental
text), so a round's stop test costs what the round added, not the answer's length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from lopa.decoding.decoder import GenerationResult, StopCheck
from lopa.detokenize import Decode, IncrementalText, text_of


def stop_check(decode: Decode, stop: Sequence[str]) -> StopCheck | None:
    """The decoder's early-stop test: any stop string in the contiguous text so far. The contiguous
    answer only grows (fills are final), so only its new ids are decoded and searched."""
    if not stop:
        return None
    text, search = IncrementalText(decode), StopSearch(stop)

    def should_stop(contiguous: list[int]) -> bool:
        nonlocal text, search
        if len(contiguous) < len(text.ids):  # not the answer seen so far: start over
            text, search = IncrementalText(decode), StopSearch(stop)
        text.extend(contiguous[len(text.ids) :])
        return search.find(text) is not None

    return should_stop


class StopSearch:
    """first_stop over a text that only grows, searching only its new end (and the few characters
    before it a stop string could begin in)."""

    def __init__(self, stop: Sequence[str], include: bool = False) -> None:
        self.stop, self.include = tuple(stop), include
        self.longest = max((len(s) for s in self.stop), default=0)
        self.cut: int | None = None  # where the answer ends, once a stop string is found
        self._searched = 0  # characters already searched

    def find(self, text: IncrementalText) -> int | None:
        """first_stop(text): the earliest stop string cannot begin before the last search's end
        less the longest stop string, or that search would have found it whole."""
        if self.cut is None and self.stop and len(text) > self._searched:
            start = max(0, self._searched - self.longest + 1)
            at = first_stop(text.tail(start), self.stop, self.include)
            self.cut = None if at is None else start + at
            self._searched = len(text)
        return self.cut

    def sendable(self, length: int) -> int:
        """How much of a text of `length` characters can no longer change: up to the stop, or all
        but what could still be the start of one."""
        if self.cut is not None:
            return self.cut
        return max(0, length - self.longest + 1) if self.longest else length


def first_stop(text: str, stop: Sequence[str], include: bool = False) -> int | None:
    """Where the answer ends at the earliest stop string of `text` (whichever is listed first): where
    it begins, or with `include` where it ends (vLLM's include_stop_str_in_output); None without."""
    found = [(text.index(s), s) for s in stop if s in text]
    if not found:
        return None
    at, first = min(found, key=lambda pair: pair[0])
    return at + len(first) if include else at


def cut_at_stop(
    result: GenerationResult, decode: Decode, stop: Sequence[str], include: bool = False
) -> tuple[str, GenerationResult] | None:
    """(text before the first stop string (through it with `include`), the result trimmed to its
    tokens), or None without a stop.

    The kept tokens are the fewest whose text covers the kept text: a token that holds the start of
    the stop string is kept when part of it precedes the stop."""
    ids = list(result.output_ids)
    text = decode(ids)
    cut = first_stop(text, stop, include)
    if cut is None:
        return None
    count = text_of(decode, ids).covering(cut)  # as a stream counts the ids it sent (streaming.py)
    kept = replace(result, output_ids=ids[:count], output_logprobs=result.output_logprobs[:count],
                   output_alternatives=result.output_alternatives[:count])
    return text[:cut], kept
