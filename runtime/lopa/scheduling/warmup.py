"""The CUDA graph buckets a server captures at start, before it reports SERVING.

On a GPU a round replays the CUDA graph of its bucket (lopa.model.cuda_graphs), captured on the
round that first needs it: 0.1-0.4 s per capture for a 7B, paid by a fresh server's first requests
(on an H200, a 7B's 8-in-flight pass in a fresh process that captured nothing at start ran at
x2.08 a lone request's throughput, a warm one at x2.64; its 13 captures took 1.06 s). So before
serving, a worker (and a local engine of several requests) captures the buckets its decoding
defaults make likely, `plan()`:

- a lone request's rounds: every row count up to k + 1 (the graphs pad rows to powers of two);
- rounds of R requests, for each request count a graph is kept for up to max_batch: each request
  with the rows it gets when R of them share the branch budget;
- windows of one and of two blocks (the TO_CACHE block and the active one), for the first
  CACHE_BUCKETS cache buckets (a request's cache grows into the next one past 256, 512, ... tokens).

Rounds outside the plan capture on first use. The plan stops after WARMUP_SECONDS. A device
without graphs (a CPU) captures nothing, and says so.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from lopa.model.graph_layout import CACHE_STEP, bucket_for, padded_requests
from lopa.model.protocol import WindowModel
from lopa.params import DecodingParams

log = logging.getLogger("lopa.execution")

CACHE_BUCKETS = 2
WARMUP_SECONDS = 60.0


@dataclass(frozen=True)
class RoundShape:
    """A round as the graphs see it: requests, rows and window of each, the cache length."""

    requests: int
    rows: int
    width: int
    cache_length: int

    @property
    def tokens(self) -> int:
        return self.requests * self.rows * self.width


def request_counts(max_batch: int) -> list[int]:
    """The request counts a batched round's graph is kept for (lopa.model.graph_layout), up to max_batch."""
    return sorted({padded_requests(r, max_batch) for r in range(2, max_batch + 1)})


def plan(
    params: DecodingParams, max_batch: int, max_length: int, budget_tokens: int | None
) -> list[RoundShape]:
    """The rounds whose buckets to capture (see the module docstring), nearest caches first."""
    block, rows_max = params.block_size, params.branches + 1
    widths = sorted({min(block * blocks, max_length) for blocks in (1, 2)})
    shapes: list[RoundShape] = []
    for bucket in range(CACHE_BUCKETS):
        cache_length = 1 if bucket == 0 else CACHE_STEP * 2 ** (bucket - 1) + 1  # the bucket's first length
        for width in widths:
            if cache_length + width > max_length:
                continue
            rows = 1
            while True:
                shapes.append(RoundShape(1, min(rows, rows_max), width, cache_length))
                if rows >= rows_max:
                    break
                rows *= 2
            for requests in request_counts(max_batch):
                each = rows_max
                if budget_tokens:
                    each = max(1, min(rows_max, budget_tokens // (requests * width)))
                shapes.append(RoundShape(requests, each, width, cache_length))
    return list(dict.fromkeys(shapes))


def warm_graphs(
    window: WindowModel, params: DecodingParams, budget_tokens: int | None, seconds: float = WARMUP_SECONDS
) -> tuple[int, float]:
    """Capture the plan's buckets on `window`'s graphs (a lopa.model.window.WindowedLM's);
    returns the graphs captured and the seconds taken, both logged ((0, 0.0) without graphs)."""
    graphs = getattr(window, "graphs", None)
    if graphs is None:
        device = getattr(window, "device", "this device")
        log.info("no CUDA graphs on %s: no graph buckets to capture before serving", device)
        return 0, 0.0
    shapes = plan(params, window.max_batch, window.max_length, budget_tokens)
    buckets = [
        bucket_for(s.rows, s.width, s.cache_length, window.max_length, s.requests, s.tokens) for s in shapes
    ]
    began = time.perf_counter()
    captured = graphs.warm([b for b in buckets if b is not None], seconds)
    took = time.perf_counter() - began
    log.info("captured %d CUDA graph buckets in %.2f s before serving (%d planned rounds: up to %d "
             "requests, k=%d, windows of %d and %d tokens, the first %d cache buckets)", captured, took,
             len(shapes), max(s.requests for s in shapes) if shapes else 0, params.branches,
             params.block_size, 2 * params.block_size, CACHE_BUCKETS)
    return captured, took
