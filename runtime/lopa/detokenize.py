"""The text of a growing answer, decoded a few ids at a time (pure).

A D2F answer only grows at its end (every fill is final), so its text is decoded incrementally:
each new id is decoded in a short window with the ids just before it, and the window's new
characters are appended. The cost of an id is a few short decodes whatever the answer's length;
decoding the whole answer every round made a 4,096-token stream cost O(n^2) tokenizer work.

The window keeps one already-decoded stretch before the new ids, so a decoder that depends on
context (SentencePiece's leading space, byte-level BPE's multi-token characters) sees what it
needs. Text stops at the last complete character: ids that end inside a character add nothing
until the id that completes it.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable

Decode = Callable[[list[int]], str]

REPLACEMENT = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 sequence to


class IncrementalText:
    """`text` is the decoded answer so far; `ends[i]` its length once `ids[: i + 1]` are decoded."""

    def __init__(self, decode: Decode) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.ends: list[int] = []
        self._chunks: list[str] = []  # the text as decoded, a piece per id that added characters
        self._starts: list[int] = []  # where each chunk begins in the text
        self._length = 0
        self._window = 0  # the first id of the decode window: context for the ids after `_read`
        self._read = 0  # ids whose text is in `text`

    @property
    def text(self) -> str:
        return "".join(self._chunks)

    def tail(self, start: int) -> str:
        """text[start:], joining only the chunks it spans."""
        first = max(0, bisect_right(self._starts, start) - 1)
        joined = "".join(self._chunks[first:])
        return joined[start - self._starts[first] :] if self._chunks else ""

    def __len__(self) -> int:
        """Characters decoded so far."""
        return self._length

    def extend(self, ids: Iterable[int]) -> None:
        for token in ids:
            self.ids.append(token)
            self._decode_last()
            self.ends.append(self._length)

    def covering(self, length: int) -> int:
        """The fewest ids whose text covers the first `length` characters (all ids when none do)."""
        if length <= 0:
            return 0
        return min(bisect_left(self.ends, length) + 1, len(self.ids))

    def _decode_last(self) -> None:
        before = self.decode(self.ids[self._window : self._read])
        after = self.decode(self.ids[self._window :])
        if after.endswith(REPLACEMENT):
            return  # inside a character: wait for the id that completes it
        new = after[len(before) :]
        if new:
            self._chunks.append(new)
            self._starts.append(self._length)
            self._length += len(new)
            self._window = self._read
        self._read = len(self.ids)


def text_of(decode: Decode, ids: Iterable[int]) -> IncrementalText:
    """The incremental text of `ids` decoded one at a time: its `ends` place every character."""
    text = IncrementalText(decode)
    text.extend(ids)
    return text
