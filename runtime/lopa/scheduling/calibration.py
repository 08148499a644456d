"""The branch budget of an accelerator, measured on its model at start.

How many tokens one forward may run before batching stops being cheap depends on the model and the
device: on an H100 a 7B forward turns compute-bound at ~256 tokens (batched rounds of 128 / 256 /
512 / 1024 tokens: 9.4 / 11.5 / 17.9 / 33.4 ms), while a small model's forwards are launch-bound
and cost about the same at 1024 tokens; a fixed count cuts a small model's branches for nothing
(runtime/BENCHMARKS.md, "Many requests at once on a GPU"). So a worker (or a local engine) on an
accelerator times lone forwards of growing size and takes the largest whose cost stays within
COST_FACTOR of the smallest: on those rounds 512 for the 7B (the budget that beat 2048 in its
concurrency sweep; 1024 would need 2.5x more than 2.5x), for a launch-bound model 1024.

At most 1024 tokens: a round runs from a CUDA graph only up to 2048 tokens (a lone request's padded
rows, a batched round's real tokens rounded up, lopa.model.graph_layout) and eagerly beyond, so a
2048-token budget would send full rounds off the graphs. The timed forwards use rows of at most 16
(the staging reserved for cache 0's graphs, lopa.model.window.graph_staging), so measuring grows
nothing.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Mapping, Sequence

import torch

from lopa.execution.faults import is_device_fault
from lopa.model.protocol import WindowBatch, WindowModel
from lopa.params import AttentionMode
from lopa.scheduling.budget import measured_on

log = logging.getLogger("lopa.execution")

TOKENS = (128, 256, 512, 1024)  # forward sizes timed
COST_FACTOR = 2.5  # a forward may cost this many times the smallest before the budget stops growing
ROW_WIDTH = 128  # the timed forwards are rows of this many tokens (of max_length when shorter)
MAX_ROWS = 16


def largest_within(times_ms: Mapping[int, float], factor: float = COST_FACTOR) -> int:
    """The largest token count whose time is at most `factor` x the smallest count's."""
    if not times_ms:
        raise ValueError("no forward times to choose a budget from")
    base = times_ms[min(times_ms)]
    return max(tokens for tokens, ms in times_ms.items() if ms <= factor * base)


def forward_ms(window: WindowModel, rows: int, width: int, repeat: int = 5, warmup: int = 2) -> float:
    """Median time of a lone forward of rows x width tokens over sequence 0's empty cache, staging
    nothing, its logits read for one token (which waits for the device)."""
    ids = torch.zeros((rows, width), dtype=torch.long)
    batch = WindowBatch(
        tokens=ids,
        lengths=[width] * rows,
        block_ids=torch.zeros_like(ids),
        start=0,
        n_stage=0,
        mode=AttentionMode.FULL,
        outputs=(0,),
        sequence=0,
    )
    times = []
    for index in range(warmup + repeat):
        began = time.perf_counter()
        window.forward(batch)[0, 0].item()
        if index >= warmup:
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def measure_step_tokens(window: WindowModel, sizes: Sequence[int] = TOKENS) -> tuple[int, dict[int, float]]:
    """(the budget, the time of each forward size: `sizes` rounded down to whole rows, those needing
    more than MAX_ROWS rows left out) for a window model whose sequence 0 holds nothing yet."""
    width = min(ROW_WIDTH, window.max_length)
    shapes = {size // width * width: size // width for size in sizes if 1 <= size // width <= MAX_ROWS}
    counts = getattr(window, "forwards", None)
    before = dict(counts or {})
    times = {tokens: forward_ms(window, rows, width) for tokens, rows in shapes.items()}
    if counts is not None:
        counts.update(before)  # the worker's forward counters are its requests'
    return largest_within(times), times


def describe(tokens: int, times_ms: Mapping[int, float]) -> str:
    measured = ", ".join(f"{size} {ms:.1f} ms" for size, ms in sorted(times_ms.items()))
    return (f"{tokens} tokens per forward (measured: {measured}; the largest within "
            f"{COST_FACTOR:g}x the smallest)")


def measured_tokens(window: WindowModel, device: str) -> int | None:
    """The budget of limits.max_step_tokens = 0 on an accelerator, measured (logged with its
    times); None on a CPU, whose default is a share of the running requests' rows rather than a
    count (lopa.scheduling.budget), or when measuring failed (logged: the fixed default applies).
    A device fault is raised: nothing after it can be trusted."""
    if not measured_on(device):
        return None
    graphs = getattr(window, "graphs", None)
    try:
        tokens, times = measure_step_tokens(window)
    except (RuntimeError, ValueError) as error:  # e.g. out of memory for the largest forward
        if is_device_fault(error):
            raise
        log.warning("could not measure the branch budget on %s (%s): the fixed default applies",
                    device, error)
        return None
    if graphs is not None and graphs.disabled:
        log.warning("a CUDA graph capture failed while measuring the branch budget on %s (see above): "
                    "the times are eager ones, the fixed default applies", device)
        return None
    log.info("branch budget on %s: %s", device, describe(tokens, times))
    return tokens
