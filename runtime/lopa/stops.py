"""How a request's answer ends before its length (pure): the one stop policy.

A request's StopPolicy holds its stop strings, whether the string that ends the answer stays in it
(vLLM's include_stop_str_in_output) and its stop tokens (vLLM's stop_token_ids: they end the answer
as the model's end tokens do). Admission checks it (check_stop_strings, check_stop_token_ids), the
decoder stops early on it (check), a stream holds back what it may still cut (search) and the
final answer is cut by it (cut): every part asks this module.

An answer cut at a stop string keeps only the tokens that produced the kept text, so token ids,
token counts, TPF and tokens/s describe what the caller receives, not what was decoded past it.
A growing answer is searched only where it grew (StopSearch over lopa.detokenize's incremental
text), so a round's stop test costs what the round added, not the answer's length.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

from lopa.decoding.decoder import GenerationResult, StopCheck
from lopa.detokenize import Decode, IncrementalText, text_of
from lopa.params import InvalidParameter, check_text, is_sequence

MAX_STOP_STRINGS = 64  # per request: each is searched in the answer after every round


@dataclass(frozen=True)
class StopPolicy:
    """A request's stop strings and stop tokens (checked where the request entered)."""

    strings: tuple[str, ...] = ()
    include: bool = False  # the stop string that ends the answer stays at its end
    token_ids: tuple[int, ...] = ()  # more tokens that end the answer, as the model's end tokens do

    def end_ids(self, eos_ids: Collection[int]) -> frozenset[int]:
        """The tokens that end this request's answer: the model's and its own."""
        return frozenset(eos_ids) | frozenset(self.token_ids)

    def check(self, decode: Decode) -> StopCheck | None:
        """The decoder's early-stop test (None: no stop string)."""
        return stop_check(decode, self.strings)

    def search(self) -> StopSearch:
        """A search over a growing answer (a stream's: what it may send)."""
        return StopSearch(self.strings, self.include)

    def cut(self, result: GenerationResult, decode: Decode) -> tuple[str, GenerationResult] | None:
        """The final answer cut at its first stop string, or None."""
        return cut_at_stop(result, decode, self.strings, self.include) if self.strings else None


def check_stop_strings(stop: Any, max_chars: int) -> tuple[str, ...]:
    """Stop strings: at most MAX_STOP_STRINGS, each non-empty and no longer than the longest answer
    (`max_chars`: a longer one could never match)."""
    if stop is None:
        return ()
    if not is_sequence(stop):
        raise InvalidParameter("stop", "must be a list of strings")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidParameter("stop", f"at most {MAX_STOP_STRINGS} stop sequences, got {len(stop)}")
    if not all(isinstance(s, str) for s in stop):
        raise InvalidParameter("stop", "must be a list of strings")
    for index, text in enumerate(stop):
        if not text:
            raise InvalidParameter(f"stop[{index}]", "stop sequences must be non-empty")
        if len(text) > max_chars:
            raise InvalidParameter(f"stop[{index}]", f"{len(text)} characters: longer than any answer of "
                                                     f"this server ({max_chars} characters at most)")
        check_text(f"stop[{index}]", text)
    return tuple(stop)


def check_stop_token_ids(value: Any, vocab_size: int, mask_id: int) -> tuple[int, ...]:
    """vLLM's stop_token_ids: token ids of the vocabulary (not the mask) that end the answer."""
    if value is None or (is_sequence(value) and not len(value)):
        return ()
    name = "stop_token_ids"
    if not is_sequence(value) or len(value) > MAX_STOP_STRINGS:
        raise InvalidParameter(name, f"must be a list of at most {MAX_STOP_STRINGS} token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise InvalidParameter(name, "must be a list of integers")
    bad = [t for t in value if not 0 <= t < vocab_size or t == mask_id]
    if bad:
        raise InvalidParameter(name, f"ids {bad[:5]} are outside the vocabulary or the mask id")
    return tuple(value)



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
