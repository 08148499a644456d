"""`lopa bench shared-prompt`: n samples of one prompt against n prompts of the same length.

In-process (the bundled model's local executor under a scheduler of its own, every branch granted,
its rounds on this thread, each verify timed: stream_cost.TimedExecutor): per pass, n requests of one
prompt with the seeds s .. s + n - 1, started together, and n requests of n different prompts of
the same length with the same seeds. Both run the same rounds on the same rows, except that the
samples of one prompt share their first forward (lopa.execution.twins): the table gives the first
round's verify time, the later rounds' median and the whole batch's wall time, the median of the
passes, and each variant's speed against the different prompts (x_different, above 1: faster).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from lopa.params import InvalidParameter
from lopa_bench.rows import check_json, finish
from lopa_bench.samples import held_out_ids
from lopa_bench.stream_cost import TimedExecutor

MAX_PROMPT_TOKENS = 256 - 32  # the bundled model's context less its answers' (max_new_tokens)
START_STRIDE = 7  # the different prompts start this many ids apart in the held-out ids


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser(
        "shared-prompt",
        help="n samples of one prompt against n different prompts of its length (in-process)",
        description="Time n requests of one prompt (its samples share the first forward) against n "
        "requests of n different prompts of the same length; print a table, write JSON.",
    )
    parser.add_argument("--n", type=int, default=8, help="requests per variant (default %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=200, help="prompt length (default %(default)s)")
    parser.add_argument("--passes", type=int, default=7, help="passes per variant, median kept (default 7)")
    parser.add_argument("--branches", type=int, default=3, help="lookahead branches (default %(default)s)")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    for name in ("n", "passes"):
        if getattr(args, name) < 1:
            raise InvalidParameter(name, f"must be >= 1, got {getattr(args, name)}")
    if not 1 <= args.prompt_tokens <= MAX_PROMPT_TOKENS:
        raise InvalidParameter("prompt_tokens", f"must be in [1, {MAX_PROMPT_TOKENS}] (the bundled model's "
                                                f"context is 256 tokens), got {args.prompt_tokens}")
    check_json(args.json)
    from lopa.engine import LocalEngine, bundled_model_dir
    from lopa.model.decoding_defaults import model_defaults
    from lopa.scheduling.alone import EVERY_BRANCH
    from lopa.scheduling.scheduler import Scheduler

    prompts = _prompts(args.n, args.prompt_tokens)
    engine = LocalEngine.from_dirs(bundled_model_dir(), max_batch=args.n)
    timed = TimedExecutor(engine.executor)
    # Its own scheduler over the timed executor, every branch granted, rounds run on this thread.
    scheduler = Scheduler(engine.decoder, timed, engine.decode, args.n, EVERY_BRANCH)
    params = model_defaults(bundled_model_dir()).with_overrides(branches=args.branches, temperature=1.0)
    _batch(scheduler, timed, [prompts[0]] * args.n, params, seed=1)  # warm-up
    passes: dict[str, list[dict[str, float]]] = {"one prompt": [], "different prompts": []}
    for p in range(args.passes):  # interleaved: a virtual machine's speed drifts
        passes["one prompt"].append(_batch(scheduler, timed, [prompts[0]] * args.n, params, 1000 * p))
        passes["different prompts"].append(_batch(scheduler, timed, prompts, params, 1000 * p))
    finish(_rows(passes, args), args.json)
    return 0


def _batch(
    scheduler: Any, timed: TimedExecutor, prompts: list[list[int]], params: Any, seed: int
) -> dict[str, float]:
    """The n requests started together and run to their end on this thread (Scheduler.run_here);
    the first round's verify time (every part over an empty cache), the later rounds' median."""
    from lopa.scheduling.request import Request, Waiter

    waiters = [Waiter() for _ in prompts]
    requests = [Request(list(ids), params.with_overrides(seed=seed + j), ignore_eos=True, on_done=waiter)
                for j, (ids, waiter) in enumerate(zip(prompts, waiters, strict=True))]
    timed.verifies.clear()
    timed.between.clear()
    began = time.perf_counter()
    scheduler.submit_many(requests)
    scheduler.run_here()
    done = [waiter.wait() for waiter in waiters]
    wall = time.perf_counter() - began
    first = [end - start for start, end, position in timed.verifies if position == 0]
    later = [end - start for start, end, position in timed.verifies if position != 0]
    return {"wall_s": wall, "first_ms": 1000 * sum(first), "later_ms": 1000 * statistics.median(later),
            "tokens": sum(len(c.result.output_ids) for c in done)}


def _prompts(n: int, tokens: int) -> list[list[int]]:
    """n different prompts of `tokens` ids each: the held-out prompts' ids in a row, from n starts."""
    ids = held_out_ids(tokens + START_STRIDE * (n - 1))
    return [ids[j * START_STRIDE : j * START_STRIDE + tokens] for j in range(n)]


def _rows(passes: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> list[dict[str, Any]]:
    baseline = statistics.median(p["wall_s"] for p in passes["different prompts"])
    rows = []
    for variant, measured in passes.items():
        wall = statistics.median(p["wall_s"] for p in measured)
        rows.append({
            "variant": f"{args.n} requests, {variant}", "n": args.n, "prompt_tokens": args.prompt_tokens,
            "branches": args.branches, "passes": args.passes,
            "first_round_ms": round(statistics.median(p["first_ms"] for p in measured), 2),
            "later_round_ms": round(statistics.median(p["later_ms"] for p in measured), 2),
            "seconds": round(wall, 3), "tokens_per_s": round(measured[0]["tokens"] / wall, 1),
            "x_different": round(baseline / wall, 3),
        })
    return rows
