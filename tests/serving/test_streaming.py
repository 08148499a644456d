"""Committed deltas for GenerateStream (lopa.serving.master.streaming)."""

from __future__ import annotations

import asyncio

import pytest

from lopa.bundled.defaults import model_defaults
from lopa.engine import LocalEngine, bundled_model_dir
from lopa.params import DecodingParams
from lopa.proto import lopa_pb2
from lopa.serving.master import jobs
from lopa.serving.master.jobs import Job, JobRunner
from lopa.serving.master.requests import ValidRequest
from lopa.serving.master.service import job_chunks
from lopa.serving.master.streaming import DeltaTracker


def test_deltas_hold_back_a_possible_stop_and_flush_at_the_end() -> None:
    vocab = {1: "ab", 2: "c", 3: "<", 4: "/", 5: "d", 9: ""}
    tracker = DeltaTracker(lambda ids: "".join(vocab[i] for i in ids), frozenset({9}), stop=("</",))
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
    tracker = DeltaTracker(lambda ids: "".join(vocab[i] for i in ids), frozenset(), stop=("<<",))
    assert tracker.step([1, 2, 3], 0) == (0, [1, 2], "ab")  # "<" might begin "<<"
    assert tracker.finish("ab<", [1, 2, 3]) == (2, [3], "<")  # the answer ended without the stop


def test_two_stop_strings_cut_at_the_earliest_whatever_their_order() -> None:
    # One step reveals both stops; the one listed first comes later in the text. The stream must
    # cut at "ba", the earliest (cut at "hm" it would send "ba", then could not finish).
    vocab = {1: "ddq", 2: "ijq", 3: "bah", 4: "hmd"}
    text = lambda ids: "".join(vocab[i] for i in ids)  # noqa: E731
    tracker = DeltaTracker(text, frozenset(), stop=("hm", "ba"))
    assert tracker.step([1, 0, 0, 0], 0) == (0, [1], "dd")  # the last character is held back
    assert tracker.step([1, 2, 3, 4], 0) == (1, [2], "qijq")  # up to "ba", not up to "hm"
    assert tracker.finish("ddqijq", [1, 2]) == (2, [], "")


def test_a_stream_whose_last_chunk_fails_ends_with_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure while building the last chunk ends the job with that error (the gRPC / HTTP stream
    reports it) instead of leaving the job unresolved and its client waiting forever."""
    engine = LocalEngine.from_dirs(bundled_model_dir(), max_batch=1)
    runner = JobRunner(engine.scheduler, engine.decode, engine.loaded.special.mask)

    def broken(_: object) -> None:
        raise ValueError("stats could not be built")

    monkeypatch.setattr(jobs, "stats_of", broken)
    params = model_defaults(bundled_model_dir()).with_overrides(max_new_tokens=8)

    async def outcome() -> object:
        request = ValidRequest(engine.encode("case:abc.def="), params, ())
        job = Job(request, asyncio.get_running_loop(), stream=True)
        runner.submit(job)
        runner.start()
        assert job.done is not None
        return await asyncio.wait_for(job.done, 30)

    try:
        result = asyncio.run(outcome())
    finally:
        engine.close()
    assert isinstance(result, ValueError) and "stats" in str(result)


def test_a_stream_closed_by_its_client_stops_its_job() -> None:
    """grpc.aio closes a stream's generator at its yield when the client cancels while a chunk is
    being written; the job must stop then too (before: it decoded to the end, holding its slot),
    and once, not when it already finished."""
    gone: list[Job] = []

    async def settle(outcome: object) -> None:
        pass

    async def run() -> tuple[bool, bool]:
        loop = asyncio.get_running_loop()
        open_job = Job(ValidRequest([1], DecodingParams(), ()), loop, stream=True)
        open_job.post(lopa_pb2.GenerateChunk(step=1, text="a"))
        chunks = job_chunks(open_job, settle, gone.append)
        assert (await anext(chunks)).text == "a"
        await chunks.aclose()  # the client went away at the yield
        finished = Job(ValidRequest([1], DecodingParams(), ()), loop, stream=True)
        finished.finish(RuntimeError("done"))
        async for _ in job_chunks(finished, settle, gone.append):
            pass
        # Ended (its deadline, in the same moment as the client's) with a chunk still unread when
        # the client went away: before, neither settled nor gone, so the request was never counted.
        raced = Job(ValidRequest([1], DecodingParams(), ()), loop, stream=True)
        raced.post(lopa_pb2.GenerateChunk(step=1, text="b"))
        raced.finish(RuntimeError("deadline"))
        chunks = job_chunks(raced, settle, gone.append)
        assert (await anext(chunks)).text == "b"
        await chunks.aclose()
        return open_job in gone, finished in gone, raced in gone

    assert asyncio.run(run()) == (True, False, True)
