"""`lopa bench stream-cost`: the master's own CPU per round along a long streamed answer.

One streamed request through the master's path (admission, the dispatcher and its deltas, the
scheduler) on a random checkpoint with a long context, decoding `--tokens` tokens with end tokens
excluded and a stop string it never meets (searched every round). The executor's calls are timed
apart by a wrapper around the local executor: the rest of the time between two rounds' forwards is
the master's work for that round. The table gives it per round near the answer's start and near
its end, and their ratio: a master whose work grows with the answer slows every request's rounds
as answers get long.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lopa.params import InvalidParameter
from lopa_bench.rows import check_json, finish

PROMPT = "Write the longest answer you can."
NEVER = "<never in the answer>"  # a stop string the answer does not hold: searched every round
EDGE = 0.1  # "start" and "end": the first and last tenth of the rounds


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser(
        "stream-cost",
        help="the master's CPU per round at the start and the end of a long streamed answer",
        description="Stream one long answer of a random long-context checkpoint through the master's "
        "path; time each round's work outside the executor near the answer's start and end; print a "
        "table, write JSON.",
    )
    parser.add_argument("--tokens", type=int, default=4096, help="the answer's length (default %(default)s)")
    parser.add_argument("--branches", type=int, default=3, help="lookahead branches (default %(default)s)")
    parser.add_argument("--block-size", type=int, default=32, help="D2F block size (default %(default)s)")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.set_defaults(handler=run)


@dataclass
class TimedExecutor:
    """The local executor with each call's time recorded: (start, end, the window's first position)
    per verify, and the time of the other calls since the last verify."""

    inner: Any
    verifies: list[tuple[float, float, int]] = field(default_factory=list)
    between: list[float] = field(default_factory=list)  # other executor calls after each verify

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def begin(self, *args: Any) -> Any:
        return self._timed(self.inner.begin, *args)

    def commit_many(self, *args: Any) -> Any:
        return self._timed(self.inner.commit_many, *args)

    def release(self, *args: Any) -> Any:
        return self._timed(self.inner.release, *args)

    def verify_many(self, parts: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.inner.verify_many(parts)
        finally:
            self.verifies.append((start, time.perf_counter(), parts[0].start))
            self.between.append(0.0)

    def _timed(self, call: Callable[..., Any], *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return call(*args)
        finally:
            if self.between:
                self.between[-1] += time.perf_counter() - start


def master_times(executor: TimedExecutor, prompt_length: int) -> list[tuple[int, float]]:
    """(the answer position a round's window starts at, the master's seconds in the round) per round:
    the time from one forward's start to the next, less the executor's calls in it."""
    rounds = []
    for (start, end, position), other, (following, _, _) in zip(
        executor.verifies, executor.between, executor.verifies[1:], strict=False
    ):
        rounds.append((position - prompt_length, following - start - (end - start) - other))
    return rounds


def summary(rounds: list[tuple[int, float]], tokens: int) -> dict:
    """The median master time of the first and the last tenth of the rounds (rounds fill about as
    many tokens each from start to end), with where their windows began in the answer."""
    edge = max(1, int(len(rounds) * EDGE))
    first, last = rounds[:edge], rounds[-edge:]
    if len(rounds) < 2:
        raise RuntimeError(f"{len(rounds)} rounds: too few to compare the answer's start and end")
    start_us = statistics.median(s for _, s in first) * 1e6
    end_us = statistics.median(s for _, s in last) * 1e6
    return {
        "tokens": tokens,
        "rounds": len(rounds) + 1,
        "start_positions": f"{first[0][0]}..{first[-1][0]}",
        "start_us_per_round": round(start_us),
        "end_positions": f"{last[0][0]}..{last[-1][0]}",
        "end_us_per_round": round(end_us),
        "end_vs_start": round(end_us / start_us, 2),
    }


def run(args: argparse.Namespace) -> int:
    for name in ("tokens", "block_size"):
        if getattr(args, name) < 1:
            raise InvalidParameter(name.replace("_", "-"), f"must be >= 1, got {getattr(args, name)}")
    if args.branches < 0:
        raise InvalidParameter("branches", f"must be >= 0, got {args.branches}")
    check_json(args.json)
    with tempfile.TemporaryDirectory(prefix="lopa-bench-stream-") as tmp:
        row = measure(Path(tmp), args.tokens, args.branches, args.block_size)
    finish([row], args.json)
    return 0


def measure(directory: Path, tokens: int, branches: int, block_size: int) -> dict:
    from lopa.engine import LocalEngine
    from lopa.params import DecodingParams
    from lopa.scheduling.scheduler import Scheduler
    from lopa.serving.master.admission import Admission, Ask
    from lopa.serving.master.dispatch import Dispatcher
    from lopa.serving.shared.config import Limits
    from lopa.serving.shared.metrics import MasterMetrics
    from lopa.synthetic.checkpoint import tiny_config, write_random_checkpoint

    length = len(PROMPT) + tokens + block_size
    print(f"writing a random checkpoint with a {length}-token context ...", flush=True)
    write_random_checkpoint(directory, tiny_config(max_position_embeddings=length))
    engine = LocalEngine.from_dirs(directory, max_length=length, max_batch=1)
    executor = TimedExecutor(engine.executor)
    scheduler = Scheduler(engine.decoder, executor, engine.decode, 1, engine.scheduler.budget)
    limits = Limits(max_new_tokens=tokens, max_prompt_tokens=len(PROMPT) + 1)
    special = engine.loaded.special
    admission = Admission(
        engine.tokenizer,
        engine.loaded.config.vocab_size,
        special.mask,
        DecodingParams(block_size=block_size),
        limits,
        length,
    )
    dispatcher = Dispatcher(admission, scheduler, engine.decode, MasterMetrics.create(), lambda: True, 3600)
    ask = Ask(
        prompt=PROMPT, max_new_tokens=tokens, stop=(NEVER,), ignore_eos=True, decoding={"branches": branches}
    )
    print(f"streaming {tokens} tokens ...", flush=True)
    began = time.perf_counter()
    sent = asyncio.run(_stream(dispatcher, ask))
    wall = time.perf_counter() - began
    dispatcher.stop()
    row = summary(master_times(executor, len(engine.encode(PROMPT))), tokens)
    return {**row, "branches": branches, "tokens_streamed": sent, "wall_s": round(wall, 1)}


async def _stream(dispatcher: Any, ask: Any) -> int:
    from lopa.serving.master.events import Finished, Progress

    (ticket,) = await dispatcher.open([ask], stream=True)
    dispatcher.start()
    sent = 0
    async for event in ticket.events():
        if isinstance(event, Progress | Finished):
            sent += len(event.token_ids)
    return sent
