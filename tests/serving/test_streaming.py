"""Committed deltas for GenerateStream (lopa.serving.master.streaming)."""

from __future__ import annotations

from lopa.serving.master.streaming import DeltaTracker


def test_deltas_hold_back_a_possible_stop_and_flush_at_the_end() -> None:
    vocab = {1: "ab", 2: "c", 3: "<", 4: "/", 5: "d", 9: ""}
    tracker = DeltaTracker(lambda ids: "".join(vocab[i] for i in ids), frozenset({9}), stop=("</",))
    mask = 0
    assert tracker.step([1, 0, 2], mask) == (0, [1], "a")  # "b" could start the stop: held back
    assert tracker.step([1, 2, 3, 0], mask) == (1, [2], "bc")  # "<" too, and its token
    # The stop arrived: the text is cut there and no id past it is sent (before the fix: [3, 4, 5]).
    assert tracker.step([1, 2, 3, 4, 5], mask) == (2, [], "")
    assert tracker.finish("abc", [1, 2]) == (2, [], "")
    plain = DeltaTracker(lambda ids: "".join(vocab[i] for i in ids), frozenset({9}))
    assert plain.step([1, 9, 2], mask) == (0, [1], "ab")  # nothing after the first EOS
    assert plain.finish("ab", [1, 9]) == (1, [9], "")  # the EOS, which has no text, comes last


def test_the_last_chunk_carries_the_ids_held_back() -> None:
    vocab = {1: "a", 2: "b", 3: "<"}
    tracker = DeltaTracker(lambda ids: "".join(vocab[i] for i in ids), frozenset(), stop=("<<",))
    assert tracker.step([1, 2, 3], 0) == (0, [1, 2], "ab")  # "<" might begin "<<"
    assert tracker.finish("ab<", [1, 2, 3]) == (2, [3], "<")  # the answer ended without the stop
