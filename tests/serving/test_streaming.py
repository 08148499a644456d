"""Committed deltas of a stream (lopa.serving.master.streaming) and a stream's end (dispatch.Ticket)."""

from __future__ import annotations

import asyncio
import time

import pytest

from lopa.engine import LocalEngine, bundled_model_dir
from lopa.model.decoding_defaults import model_defaults
from lopa.params import DecodingParams
from lopa.scheduling.request import Request
from lopa.serving.master import dispatch
from lopa.serving.master.admission import Admission, Ask
from lopa.serving.master.dispatch import Dispatcher, Ticket
from lopa.serving.master.events import Progress
from lopa.serving.master.streaming import DeltaTracker
from lopa.serving.shared.config import Limits
from lopa.serving.shared.metrics import MasterMetrics
from lopa.stops import StopPolicy


def test_deltas_hold_back_a_possible_stop_and_flush_at_the_end() -> None:
    vocab = {1: "ab", 2: "c", 3: "<", 4: "/", 5: "d", 9: ""}
    decode = lambda ids: "".join(vocab[i] for i in ids)  # noqa: E731
    tracker = DeltaTracker(decode, frozenset({9}), stop=StopPolicy(("</",)))
    mask = 0
    assert tracker.step([1, 0, 2], mask) == (0, [1], "a")  # "b" could start the stop: held back
    assert tracker.step([1, 2, 3, 0], mask) == (1, [2], "bc")  # "<" too, and its token
    # The stop arrived: the text is cut there and no id past it is sent (not [3, 4, 5]).
    assert tracker.step([1, 2, 3, 4, 5], mask) == (2, [], "")
    assert tracker.finish("abc", [1, 2]) == (2, [], "")
    plain = DeltaTracker(lambda ids: "".join(vocab[i] for i in ids), frozenset({9}))
    assert plain.step([1, 9, 2], mask) == (0, [1], "ab")  # nothing after the first EOS
    assert plain.finish("ab", [1, 9]) == (1, [9], "")  # the EOS, which has no text, comes last


def test_the_last_chunk_carries_the_ids_held_back() -> None:
    vocab = {1: "a", 2: "b", 3: "<"}
    tracker = DeltaTracker(lambda ids: "".join(vocab[i] for i in ids), frozenset(), stop=StopPolicy(("<<",)))
    assert tracker.step([1, 2, 3], 0) == (0, [1, 2], "ab")  # "<" might begin "<<"
    assert tracker.finish("ab<", [1, 2, 3]) == (2, [3], "<")  # the answer ended without the stop


def test_two_stop_strings_cut_at_the_earliest_whatever_their_order() -> None:
    # One step reveals both stops; the one listed first comes later in the text. The stream must
    # cut at "ba", the earliest (cut at "hm" it would send "ba", then could not finish).
    vocab = {1: "ddq", 2: "ijq", 3: "bah", 4: "hmd"}
    text = lambda ids: "".join(vocab[i] for i in ids)  # noqa: E731
    tracker = DeltaTracker(text, frozenset(), stop=StopPolicy(("hm", "ba")))
    assert tracker.step([1, 0, 0, 0], 0) == (0, [1], "dd")  # the last character is held back
    assert tracker.step([1, 2, 3, 4], 0) == (1, [2], "qijq")  # up to "ba", not up to "hm"
    assert tracker.finish("ddqijq", [1, 2]) == (2, [], "")


def test_a_stream_whose_end_fails_ends_with_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure while building a stream's end ends the request with that error (the gRPC / HTTP
    stream reports it) instead of leaving it unresolved and its client waiting forever."""
    engine = LocalEngine.from_dirs(bundled_model_dir(), max_batch=1)
    params = model_defaults(bundled_model_dir())
    admission = Admission(engine.tokenizer, engine.loaded.config.vocab_size, engine.loaded.special.mask,
                          params, Limits(), engine.max_length)
    dispatcher = Dispatcher(admission, engine.scheduler, engine.decode, MasterMetrics.create(),
                            lambda: True, 30)

    def broken(*_: object) -> None:
        raise ValueError("the end could not be built")

    monkeypatch.setattr(dispatch.DeltaTracker, "finish", broken)

    async def outcome() -> object:
        (ticket,) = await dispatcher.open([Ask(prompt="case:abc.def=", max_new_tokens=8)], stream=True)
        dispatcher.start()
        try:
            async for _ in ticket.events():
                pass
        except ValueError as error:
            return error
        return None

    try:
        result = asyncio.run(asyncio.wait_for(outcome(), 30))
    finally:
        engine.close()
    assert isinstance(result, ValueError) and "could not be built" in str(result)


def test_a_stream_closed_by_its_client_stops_its_request() -> None:
    """grpc.aio closes a stream's generator at its yield when the client cancels while a chunk is
    being written; the request must stop then too (not decode to the end, holding its slot), and
    be counted once: cancelled, unless its end was read."""
    counted: list[str] = []

    async def run() -> tuple[bool, bool, bool]:
        loop = asyncio.get_running_loop()

        def ticket() -> Ticket:
            return Ticket(Request([1], DecodingParams()), True, loop, counted.append, time.monotonic() + 60)

        progress = Progress(1, 0, [], "a", [], 1, 0, 0)
        open_one = ticket()
        open_one.post(progress)
        events = open_one.events()
        assert (await anext(events)).text == "a"
        await events.aclose()  # the client went away at the yield
        finished = ticket()
        finished.post(RuntimeError("done"))
        with pytest.raises(RuntimeError):
            async for _ in finished.events():
                pass
        # Ended (its deadline, in the same moment as the client's) with a chunk still unread when
        # the client went away: counted once, as cancelled.
        raced = ticket()
        raced.post(progress)
        raced.post(RuntimeError("deadline"))
        events = raced.events()
        assert (await anext(events)).text == "a"
        await events.aclose()
        return (open_one.abort.cancelled.is_set(), finished.abort.cancelled.is_set(),
                raced.abort.cancelled.is_set())

    assert asyncio.run(run()) == (True, False, True)
    assert counted == ["cancelled", "error", "cancelled"]


def test_a_cancel_at_the_clients_deadline_counts_as_a_deadline() -> None:
    """The client's deadline runs from when it sent the request, the master's from when it read it,
    a little later: a cancel just before the master's deadline is the client's passing. A cancel
    well before it is the client leaving."""
    counted: list[str] = []

    async def run() -> None:
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        for left in (dispatch.CLIENT_DEADLINE_LEAD_S / 2, 30.0):
            Ticket(Request([1], DecodingParams()), True, loop, counted.append, now + left).cancel()

    asyncio.run(run())
    assert counted == ["deadline", "cancelled"]
