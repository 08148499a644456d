"""A concurrency sweep: the same requests with 1, 2, 4, 8, 16 in flight.

Closed loop: `concurrency` clients each send their next request as soon as the last one answered,
until every request of the level was sent. Per level: aggregate tokens/s (all tokens over the
level's wall time), per-request tokens/s (tokens over that request's own latency, averaged), p50 and
p99 latency (queueing included), TPF, the lookahead branches granted per round (over every request's
rounds), and the two factors
of any speedup: work_per_token (verified window tokens per generated token) and us_per_verified
(wall time per verified token). Every row holds its ratios to the first level (one request at a
time), measured in the same run: speedup, p99_x_lone and p99_slowdown (see with_ratios).

Transport-free: a `Send` maps a request index to its Answer, so the local engine (`lopa bench
concurrency`) and a served group (`lopa bench serving`) share the sweep and its table.

On a shared or virtual machine the speed of the host drifts by tens of percent within a minute, so
one pass over the levels can compare a fast moment with a slow one. With `passes` > 1 the levels
run interleaved (1, 8, 1, 8, ...): every ratio is taken within its own pass, and each level's row
holds the median over the passes (`combine`), its ratios the median of the passes' ratios.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from lopa.params import InvalidParameter
from lopa_bench.rows import percentile, public

LEVELS = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Answer:
    tokens: int
    forwards: int
    mean_branches: float  # lookahead branches granted per round
    verified_tokens: int  # window tokens its verification forwards ran (GenerationResult)


Send = Callable[[int], Answer]
# CUDA graphs captured so far and the seconds they took (a local engine on a GPU): a level's row
# holds the captures its rounds paid for (`captures`, `capture_s`).
Captures = Callable[[], tuple[int, float]]


def captures_of(window: object) -> Captures | None:
    """The graph-capture probe of a window model (lopa.model.window), None when it has no graphs
    (a CPU, or LOPA_CUDA_GRAPHS=0): its rows then have no capture columns."""
    if getattr(window, "graphs", None) is None:
        return None
    return window.graph_captures  # type: ignore[attr-defined]


def run_level(send: Send, requests: int, concurrency: int, captures: Captures | None = None) -> dict:
    answers: list[tuple[Answer, float]] = []
    captured_before = captures() if captures else (0, 0.0)

    def timed(index: int) -> tuple[Answer, float]:
        began = time.perf_counter()
        answer = send(index)
        return answer, time.perf_counter() - began

    began = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(timed, range(requests)))
    wall = time.perf_counter() - began
    captured = {}
    if captures:
        count, seconds = captures()
        captured = {"captures": count - captured_before[0],
                    "capture_s": round(seconds - captured_before[1], 2)}
    tokens = sum(a.tokens for a, _ in answers)
    forwards = sum(a.forwards for a, _ in answers)
    verified = sum(a.verified_tokens for a, _ in answers)
    latencies = [s for _, s in answers]
    return {
        "concurrency": concurrency,
        "requests": requests,
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tok_s": round(tokens / wall, 1),
        "per_request_tok_s": round(statistics.mean(a.tokens / s for a, s in answers), 1),
        "p50_s": round(percentile(latencies, 50), 3),
        "p99_s": round(percentile(latencies, 99), 3),
        "tpf": round(tokens / forwards, 3) if forwards else 0.0,
        # Per round of every request (a request's rounds are its forwards), not per request.
        "mean_branches": round(sum(a.mean_branches * a.forwards for a, _ in answers) / forwards, 3)
        if forwards else 0.0,
        # The two factors of a speedup: verified tokens per generated token (fewer when the budget
        # grants fewer branches) and wall time per verified token (lower when a batched forward
        # costs less per token than a lone one: an accelerator's gain, hardly a CPU's).
        "work_per_token": round(verified / tokens, 2) if tokens else 0.0,
        "us_per_verified": round(wall * 1e6 / verified, 2) if verified else 0.0,
        **captured,
        "_latencies": latencies,  # by request index: for p99_slowdown (not shown, see lopa_bench.rows)
    }


def sweep(
    send: Send, requests: int, levels: Sequence[int] = LEVELS, warmup: int = 2,
    show: Callable[[dict], None] = lambda row: None, passes: int = 1, captures: Captures | None = None,
) -> list[dict]:
    """One row per level, `warmup` requests first (not measured); see with_ratios and combine."""
    for index in range(warmup):
        send(index % requests)
    runs: list[list[dict]] = []
    for number in range(passes):
        rows: list[dict] = []
        for level in levels:
            rows.append(run_level(send, requests, level, captures))
            with_ratios(rows)
            show({"pass": number + 1, **rows[-1]} if passes > 1 else rows[-1])
        runs.append(rows)
    return combine(runs)


# Measured quantities a combined row takes the median of (and their rounding digits); the rest (the
# level, counts) are the same in every pass.
_MEDIAN_DIGITS = {"wall_s": 3, "tok_s": 1, "per_request_tok_s": 1, "p50_s": 3, "p99_s": 3, "tpf": 3,
                  "mean_branches": 3, "work_per_token": 2, "us_per_verified": 2, "speedup": 2,
                  "p99_x_lone": 2, "p99_slowdown": 2, "captures": 1, "capture_s": 2}


def combine(runs: Sequence[Sequence[dict]]) -> list[dict]:
    """The rows of several passes over the same levels -> one row per level: the median of each
    measured quantity over the passes (ratios: of the per-pass ratios), plus `passes` and the
    range of the per-pass speedups. One pass comes back as measured; either way
    without the working keys (lopa_bench.rows.public)."""
    if len(runs) == 1:
        return [public(row) for row in runs[0]]
    if len({len(rows) for rows in runs}) != 1:
        raise ValueError("every pass must cover the same levels")
    combined = []
    for rows in zip(*runs, strict=True):
        row = public(rows[0])
        for key, digits in _MEDIAN_DIGITS.items():
            if key in row:
                row[key] = round(statistics.median(r[key] for r in rows), digits)
        speedups = [r["speedup"] for r in rows]
        row["passes"] = len(rows)
        row["speedup_range"] = f"{min(speedups):.2f}-{max(speedups):.2f}"
        combined.append(row)
    return combined


def with_ratios(rows: list[dict]) -> list[dict]:
    """Adds to the last row speedup (its tok_s over the first row's), p99_x_lone (its p99 latency
    over the first row's p50: a lone request's latency when the first level is 1) and, when both
    rows hold their latencies by request, p99_slowdown: the p99 over the requests of each one's
    latency over its own latency in the first row (how much slower load makes a request, without
    the spread between short and long requests that p99_x_lone also counts)."""
    first, row = rows[0], rows[-1]
    row["speedup"] = round(row["tok_s"] / first["tok_s"], 2)
    row["p99_x_lone"] = round(row["p99_s"] / first["p50_s"], 2)
    alone, loaded = first.get("_latencies"), row.get("_latencies")
    if alone and loaded and len(alone) == len(loaded):
        row["p99_slowdown"] = round(percentile([t / a for t, a in zip(loaded, alone, strict=True)], 99), 2)
    return rows


def sweep_flags(levels: str, levels_flag: str, requests: int, passes: int = 1) -> list[int]:
    """The levels of a sweep's comma-separated flag; InvalidParameter naming the flag at fault."""
    parsed = positive_ints(levels, levels_flag, "level")
    if requests < 1:
        raise InvalidParameter("requests", f"must be >= 1, got {requests}")
    if max(parsed) > requests:  # else the level's row names more in flight than ever were
        top = max(parsed)
        raise InvalidParameter(levels_flag, f"{top} in flight needs --requests >= {top}, got {requests}")
    if passes < 1:
        raise InvalidParameter("passes", f"must be >= 1, got {passes}")
    return parsed


def positive_ints(text: str, flag: str, noun: str = "value") -> list[int]:
    """A comma-separated flag of integers >= 1 (levels, worker counts); InvalidParameter naming it."""
    try:
        parsed = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise InvalidParameter(flag, f"not a comma-separated list of integers: {text!r}") from None
    if not parsed or min(parsed) < 1:
        raise InvalidParameter(flag, f"every {noun} must be >= 1, got {text!r}")
    return parsed
