"""Verification forwards replayed as CUDA graphs, one graph per shape bucket.

A 7B forward is ~600 kernels; launched one by one from Python they take longer than the GPU needs
to run them. A graph replays them in one launch. Graphs have static shapes and addresses, so a
forward is padded up to a bucket (rows to a power of two, the window to a multiple of
WIDTH_STEP, the cache read to a multiple of CACHE_STEP: the unused tail is masked) and its
inputs are written into that bucket's static buffer: ONE host-to-device copy per step. The graph
covers everything but the lm_head, which runs on the tokens whose logits are needed only.

What a graph captures: the embedding, the mask (built on the device from the packed inputs),
every layer, the staging of every row's K/V (all `width` tokens of each row: the caller records
how many of them are the real TO_CACHE tokens) and the final norm. Graphs share one memory pool;
the graph captured for a bucket is reused until the staging area is reallocated (then every
graph is dropped and recaptured on demand, since they hold its address; the pool goes with the
last graph, so a new one is opened). A capture that fails turns graphs off for the model: the
failed capture may leave CUDA state behind, and eager forwards are always correct.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from lopa.model.dream import DreamModel
from lopa.model.kv_cache import KVCache
from lopa.model.mask import additive, window_mask

log = logging.getLogger("lopa.model")

WIDTH_STEP = 16
CACHE_STEP = 256
MAX_ROWS = 64
MAX_WIDTH = 256  # wider windows (a prefill) gain nothing from a graph: they run eagerly
MAX_TOKENS = 2048  # rows * width of the largest captured forward; larger ones run eagerly


@dataclass(frozen=True)
class Bucket:
    rows: int
    width: int
    cache_width: int

    @property
    def tokens(self) -> int:
        return self.rows * self.width


def bucket_for(rows: int, width: int, cache_length: int, max_length: int) -> Bucket | None:
    """The bucket a forward is padded to, or None when it is too large to capture."""
    padded_rows = 1 << max(0, rows - 1).bit_length()
    padded_width = -(-width // WIDTH_STEP) * WIDTH_STEP
    cache_width = min(max_length, -(-cache_length // CACHE_STEP) * CACHE_STEP)
    too_large = padded_rows > MAX_ROWS or padded_width > MAX_WIDTH or padded_rows * padded_width > MAX_TOKENS
    if too_large or padded_width > max_length:
        return None
    return Bucket(padded_rows, padded_width, cache_width)


class _CacheView:
    """The KVSource of a captured forward: a fixed number of cache positions."""

    def __init__(self, kv: KVCache, width: int) -> None:
        self.kv, self.width = kv, width

    def cached(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv.cached(layer, self.width)


class PackedInputs:
    """The int64 layout of a bucket's inputs: tokens [T], block ids [T], lengths [R], start,
    cache length, block_causal, then up to T + R output indices (read after the replay)."""

    def __init__(self, bucket: Bucket) -> None:
        t, r = bucket.tokens, bucket.rows
        self.bucket = bucket
        self.tokens = slice(0, t)
        self.block_ids = slice(t, 2 * t)
        self.lengths = slice(2 * t, 2 * t + r)
        self.scalars = 2 * t + r  # start, cache length, block_causal
        self.outputs = 2 * t + r + 3
        self.size = self.outputs + t + r


class _Captured:
    def __init__(self, bucket: Bucket, device: torch.device) -> None:
        self.layout = PackedInputs(bucket)
        self.inputs = torch.zeros(self.layout.size, dtype=torch.long, device=device)
        self.host = torch.zeros(self.layout.size, dtype=torch.long, pin_memory=True)
        self.graph = torch.cuda.CUDAGraph()
        self.hidden: torch.Tensor | None = None  # [T, hidden], the graph's static output
        self.staging_ptr = 0
        self.copied = torch.cuda.Event()  # the last host-to-device copy of `host` is done

    def write_inputs(self) -> None:
        """Send `host` to the device (asynchronously: `host` is pinned)."""
        self.inputs.copy_(self.host, non_blocking=True)
        self.copied.record()

    def host_inputs(self) -> torch.Tensor:
        """`host`, once the previous copy out of it has finished (it is about to be rewritten)."""
        self.copied.synchronize()
        return self.host


class WindowGraphs:
    """Lazily captured graphs of `model.hidden_states` over `kv`, keyed by bucket."""

    def __init__(self, model: DreamModel, kv: KVCache) -> None:
        self.model, self.kv = model, kv
        self.device = model.device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[Bucket, _Captured] = {}
        self.disabled = False

    def get(self, bucket: Bucket) -> _Captured | None:
        """The graph of `bucket` (captured now if new), or None when graphs are off."""
        if self.disabled:
            return None
        self.kv.ensure_staging(bucket.rows, bucket.width)  # may move the staging area
        staging = self.kv.staging_ptr()
        stale = [b for b, c in self.graphs.items() if c.staging_ptr != staging]
        for old in stale:
            del self.graphs[old]  # it writes to the old staging area
        if stale and not self.graphs:
            # The pool was released with its last graph; capturing into its handle again is an error.
            self.pool = torch.cuda.graph_pool_handle()
        captured = self.graphs.get(bucket)
        if captured is None:
            captured = self._capture(bucket)
            if captured is None:
                self.disabled = True
                return None
            self.graphs[bucket] = captured
        return captured

    def _body(self, captured: _Captured) -> torch.Tensor:
        layout, bucket = captured.layout, captured.layout.bucket
        ints = captured.inputs
        tokens = ints[layout.tokens].view(1, bucket.tokens)
        block_ids = ints[layout.block_ids].view(bucket.rows, bucket.width)
        lengths = ints[layout.lengths]
        start, cache_length, block_causal = ints[layout.scalars : layout.scalars + 3]
        positions = start + torch.arange(bucket.width, device=self.device).repeat(bucket.rows)
        mask = window_mask(lengths, block_ids, cache_length, bucket.cache_width, block_causal.bool())
        self.kv.stage_rows(bucket.rows, bucket.width)
        hidden = self.model.hidden_states(
            tokens,
            positions,
            additive(mask, self.model.dtype),
            _CacheView(self.kv, bucket.cache_width),
            self.kv.stage,
        )
        return hidden.view(bucket.tokens, -1)

    def _capture(self, bucket: Bucket) -> _Captured | None:
        captured = _Captured(bucket, self.device)
        # Valid inputs for the warm-up run: one token per row, nothing cached.
        captured.inputs[captured.layout.lengths] = 1
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side), torch.no_grad():
                self._body(captured)  # warm-up: library handles and workspaces exist before capture
            torch.cuda.current_stream(self.device).wait_stream(side)
            capture = torch.cuda.graph(captured.graph, pool=self.pool, capture_error_mode="thread_local")
            with torch.no_grad(), capture:
                captured.hidden = self._body(captured)
        except RuntimeError as error:
            log.warning("cannot capture a CUDA graph for %s: %s; CUDA graphs are off for this model",
                        bucket, error)
            return None
        captured.staging_ptr = self.kv.staging_ptr()
        log.debug("captured a CUDA graph for %s", bucket)
        return captured
