"""Stop strings (pure): when decoding may stop, and where the answer is cut.

An answer cut at a stop string keeps only the tokens that produced the kept text, so token ids,
token counts, TPF and tokens/s describe what the caller receives, not what was decoded past it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from lopa.decoding.decoder import GenerationResult, StopCheck

Decode = Callable[[list[int]], str]


def stop_check(decode: Decode, stop: Sequence[str]) -> StopCheck | None:
    """The decoder's early-stop test: any stop string in the contiguous text so far."""
    if not stop:
        return None

    def should_stop(contiguous: list[int]) -> bool:
        text = decode(contiguous)
        return any(s in text for s in stop)

    return should_stop


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
    count = next(n for n in range(len(ids) + 1) if len(decode(ids[:n])) >= cut)
    return text[:cut], replace(result, output_ids=ids[:count], output_logprobs=result.output_logprobs[:count])
