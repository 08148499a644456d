"""Verification rounds replayed as CUDA graphs, one graph per shape bucket.

A 7B forward is ~600 kernels; launched one by one from Python they take longer than the GPU needs
to run them. A graph replays them in one launch. Graphs have static shapes and addresses, so a
round is padded up to a bucket (its requests' rows to one power of two, the window to a multiple
of WIDTH_STEP, the cache read to a power of two of at least CACHE_STEP: the unused tail is masked)
and its inputs are written into that bucket's static buffer: ONE host-to-device copy per round.
The graph covers everything but the lm_head, which runs on the tokens whose logits are needed only.

Every bucket is captured on the round that first needs it (0.1-0.4 s for a 7B), so the fewer
buckets a workload meets, the fewer rounds pay a capture. Hence powers of two for the cache read
(attention over a masked tail costs little beside the linears), and a round of R requests without
a graph of its own replays (capturing it if new) the graph of padded_requests(R) requests for its
first SPECIALIZE_AFTER rounds, and then gets its own, so a steady load does not pay the padding's
tokens for good. The padding requests are one-token rows over an empty cache read, run in the
physical caches after the round's; those may hold other sequences, whose committed K/V they never
touch. They overwrite those caches' staging, which holds nothing to keep: every round's commits
precede the next forward (the window model discards those staged counts, so a late commit fails).

A round of R requests (one, or several batched by the scheduler) replays the graph of R (or of
padded_requests(R)) requests, which reads the KV caches of the model's first physical sequences:
the window model moves a
round's requests there first (DreamWindowModel._place_front; a copy of the committed prefix, only
when the running set changed). Request i of the bucket is the one in physical sequence i; its
tokens are the i-th block of rows x width tokens, attending only to its own cache and rows. The
physical caches are slices of one tensor and every request of a bucket has the same shape, so a
layer attends for all of them in one call (batch = request), builds their masks together and
stages their K/V with one copy each.

What a graph captures: the embedding, the masks (built on the device from the packed inputs),
every layer, the staging of every row's K/V (all `width` tokens of each row: the caller records
how many of them are the real TO_CACHE tokens) and the final norm. Graphs share one memory pool;
the graph captured for a bucket is reused until a staging area it writes is reallocated (then it
is dropped and recaptured on demand, since it holds the address; the pool goes with the last
graph, so a new one is opened). A capture that fails turns graphs off (for batched rounds only when
it was one: a lone request keeps its graphs): a failed capture may leave CUDA state behind, and
eager forwards are always correct.

`graph_body` and `PackedInputs.write` are plain torch and run on any device; WindowGraphs with
capture=False runs the body on every replay instead of capturing it (how the CPU tests check the
whole path without a GPU).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from lopa.execution.protocol import WindowBatch
from lopa.model.attention import UniformSegments
from lopa.model.dream import DreamModel
from lopa.model.kv_cache import KVCache
from lopa.model.mask import additive, window_masks
from lopa.params import AttentionMode

log = logging.getLogger("lopa.model")

WIDTH_STEP = 16
CACHE_STEP = 256
MAX_ROWS = 64
MAX_WIDTH = 256  # wider windows (a prefill) gain nothing from a graph: they run eagerly
MAX_TOKENS = 2048  # tokens of the largest captured round (every request's padded rows); larger run eagerly
# The widest window of a batched round's graph: each request's staging must hold rows x width, and a
# prompt-sized window (a request's first round) would grow every cache's staging to that size.
MAX_BATCHED_WIDTH = 128
# Rounds of a request count that has no graph of its own replay a padded one this many times first.
SPECIALIZE_AFTER = 16


@dataclass(frozen=True)
class Bucket:
    rows: int  # per request
    width: int
    cache_width: int
    requests: int = 1

    @property
    def request_tokens(self) -> int:
        return self.rows * self.width

    @property
    def tokens(self) -> int:
        return self.requests * self.rows * self.width


def bucket_for(rows: int, width: int, cache_length: int, max_length: int, requests: int = 1) -> Bucket | None:
    """The bucket a round is padded to (rows, width, cache_length: the largest of its requests'),
    or None when it is too large to capture."""
    cache_width = 0 if cache_length <= 0 else min(max_length, max(CACHE_STEP, _power_of_two(cache_length)))
    bucket = Bucket(_power_of_two(rows), -(-width // WIDTH_STEP) * WIDTH_STEP, cache_width, requests)
    return bucket if fits(bucket, max_length) else None


def fits(bucket: Bucket, max_length: int) -> bool:
    """Whether a graph is captured for this bucket (larger rounds run eagerly)."""
    widest = MAX_WIDTH if bucket.requests == 1 else MAX_BATCHED_WIDTH
    too_large = bucket.rows > MAX_ROWS or bucket.width > widest or bucket.tokens > MAX_TOKENS
    return not too_large and bucket.width <= max_length


def padded_requests(requests: int, limit: int) -> int:
    """The request count a round of `requests` may replay the graph of: the next of 1, 2, 3, 4, 6,
    8, 12, 16, 24, ... (a power of two or three quarters of one: at most a third of its rows are
    padding), at most `limit` (the physical caches there are)."""
    power = _power_of_two(requests)
    three_quarters = 3 * power // 4
    return max(requests, min(limit, three_quarters if three_quarters >= requests else power))


def _power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class _CacheView:
    """The KVSource of a captured forward: a fixed number of cache positions."""

    def __init__(self, kv: KVCache, width: int) -> None:
        self.kv, self.width = kv, width

    def cached(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv.cached(layer, self.width)


class PackedInputs:
    """The int64 layout of a bucket's inputs: tokens [T], block ids [T], lengths [R x rows], then
    per request its start, cache length and block_causal, then up to T + R x rows output indices
    (read after the replay). T counts every request's padded rows; request i's are the i-th block."""

    def __init__(self, bucket: Bucket) -> None:
        t, r = bucket.tokens, bucket.requests * bucket.rows
        self.bucket = bucket
        self.tokens = slice(0, t)
        self.block_ids = slice(t, 2 * t)
        self.lengths = slice(2 * t, 2 * t + r)
        self.scalars = 2 * t + r  # per request: start, cache length, block_causal
        self.outputs = self.scalars + 3 * bucket.requests
        self.size = self.outputs + t + r

    def write(
        self, host: torch.Tensor, batches: Sequence[WindowBatch], cache_lengths: Sequence[int]
    ) -> list[int]:
        """Write the round (request i = batches[i], over a cache of cache_lengths[i]) into a zeroed
        `host`; returns each request's output count (its indices follow the previous request's).
        Per request only its tokens and block ids are copied (its rows keep their own width); the
        other fields are gathered in Python and written with one tensor each: small torch calls
        per request were ~26 us each round and request, host time on a GPU's critical path."""
        bucket = self.bucket
        tokens = host[self.tokens].view(bucket.requests, bucket.rows, bucket.width)
        block_ids = host[self.block_ids].view(bucket.requests, bucket.rows, bucket.width)
        lengths = [1] * (bucket.requests * bucket.rows)  # padding rows: one token that sees itself
        scalars: list[int] = []  # per request: start, cache length, block_causal
        outputs: list[int] = []
        counts: list[int] = []
        for i, (batch, cache_length) in enumerate(zip(batches, cache_lengths, strict=True)):
            tokens[i, : batch.rows, : batch.width] = batch.tokens
            block_ids[i, : batch.rows, : batch.width] = batch.block_ids
            if len(batch.lengths) != batch.rows:  # a list slice would silently resize
                raise ValueError(f"write: {len(batch.lengths)} lengths for {batch.rows} rows")
            lengths[i * bucket.rows : i * bucket.rows + batch.rows] = batch.lengths
            block_causal = AttentionMode(batch.mode) is AttentionMode.BLOCK_CAUSAL
            scalars += (batch.start, cache_length, int(block_causal))
            assert batch.outputs is not None
            outputs += batch.outputs
            counts.append(len(batch.outputs))
        host[self.lengths] = torch.tensor(lengths)
        host[self.scalars : self.scalars + len(scalars)] = torch.tensor(scalars)
        # Output indices are flat in each caller's [rows, width] layout: re-based on the bucket's.
        flat = torch.tensor(outputs, dtype=torch.long)
        if len(batches) == 1:  # a lone request: one width, its block starts the bucket
            width = batches[0].width
            rebased = flat // width * bucket.width + flat % width
        else:  # each index with its request's width and block
            repeats = torch.tensor(counts, dtype=torch.long)
            widths = torch.tensor([batch.width for batch in batches]).repeat_interleave(repeats)
            starts = (torch.arange(len(batches)) * bucket.request_tokens).repeat_interleave(repeats)
            rebased = starts + flat // widths * bucket.width + flat % widths
        host[self.outputs : self.outputs + flat.numel()] = rebased
        return counts


def graph_body(
    model: DreamModel,
    caches: Sequence[KVCache],
    layout: PackedInputs,
    ints: torch.Tensor,
    stacked: torch.Tensor,
) -> torch.Tensor:
    """The hidden states [T, hidden] of the round packed in `ints` (on the model's device), request i
    over caches[i]; stages every row's K/V. Only tensor operations: a CUDA graph can capture it.
    stacked: the tensor whose slice i is caches[i].cache (DreamWindowModel.kv_storage): several
    requests attend in one call per layer (UniformSegments), not one call each."""
    bucket, device = layout.bucket, model.device
    tokens = ints[layout.tokens].view(1, bucket.tokens)
    block_ids = ints[layout.block_ids].view(bucket.requests, bucket.rows, bucket.width)
    lengths = ints[layout.lengths].view(bucket.requests, bucket.rows)
    scalars = ints[layout.scalars : layout.outputs].view(bucket.requests, 3)
    steps = torch.arange(bucket.width, device=device).repeat(bucket.rows)
    positions = (scalars[:, 0:1] + steps).reshape(-1)
    kvs = caches[: bucket.requests]
    for kv in kvs:
        kv.stage_rows(bucket.rows, bucket.width)
    bool_masks = window_masks(lengths, block_ids, scalars[:, 1], bucket.cache_width, scalars[:, 2].bool())
    masks = additive(bool_masks, model.dtype)  # [R, 1, rows x width, cache_width + rows x width]
    if len(kvs) == 1:  # a lone request: one sequence, as its eager forward runs it
        view = _CacheView(kvs[0], bucket.cache_width)
        hidden = model.hidden_states(tokens, positions, masks, view, kvs[0].stage)
    else:
        hidden = model.hidden_states(tokens, positions, segments=_uniform(kvs, masks, stacked, bucket))
    return hidden.view(bucket.tokens, -1)


def _uniform(
    kvs: Sequence[KVCache], masks: torch.Tensor, stacked: torch.Tensor, bucket: Bucket
) -> UniformSegments:
    """The bucket's requests as UniformSegments over the first R slices of `stacked`."""
    requests, width = bucket.requests, bucket.cache_width

    def past(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return stacked[:requests, layer, 0, :width], stacked[:requests, layer, 1, :width]

    def stage(layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        shape = (requests, bucket.rows, bucket.width, *keys.shape[2:])
        pairs = torch.stack((keys.view(shape), values.view(shape)), dim=2)  # [R, rows, 2, width, ...]
        for i, kv in enumerate(kvs):
            kv.stage_pair(layer, pairs[i])

    return UniformSegments(requests, masks, past, stage)


class _Captured:
    def __init__(self, bucket: Bucket, device: torch.device) -> None:
        self.layout = PackedInputs(bucket)
        self.inputs = torch.zeros(self.layout.size, dtype=torch.long, device=device)
        pinned = device.type == "cuda"
        self.host = torch.zeros(self.layout.size, dtype=torch.long, pin_memory=pinned)
        self.graph = torch.cuda.CUDAGraph() if pinned else None
        self.run: Callable[[], torch.Tensor] | None = None  # the body, when not captured
        self.hidden: torch.Tensor | None = None  # [T, hidden], the graph's static output
        self.staging: tuple[int, ...] = ()  # the generation of each staging area it writes
        self.copied = torch.cuda.Event() if pinned else None  # the last copy out of `host` is done

    def write_inputs(self) -> None:
        """Send `host` to the device (asynchronously: `host` is pinned)."""
        self.inputs.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def host_inputs(self) -> torch.Tensor:
        """`host`, once the previous copy out of it has finished (it is about to be rewritten)."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host

    def replay(self) -> torch.Tensor:
        if self.run is not None:
            self.hidden = self.run()
        else:
            assert self.graph is not None
            self.graph.replay()
        assert self.hidden is not None
        return self.hidden


class WindowGraphs:
    """Lazily captured graphs of rounds over the model's physical sequences `caches` (the graph of
    R requests reads caches[:R]), keyed by bucket."""

    def __init__(
        self,
        model: DreamModel,
        caches: Sequence[KVCache],
        stacked: torch.Tensor,
        capture: bool = True,
    ) -> None:
        """stacked: the tensor the caches are slices of, in order (DreamWindowModel.kv_storage)."""
        self.model, self.caches, self.capture = model, list(caches), capture
        if len(self.caches) > stacked.shape[0] or not all(
            kv.cache.data_ptr() == stacked[i].data_ptr() and kv.cache.shape == stacked.shape[1:]
            for i, kv in enumerate(self.caches)
        ):
            raise ValueError("WindowGraphs: caches[i] must be slice i of the stacked KV storage")
        self.stacked = stacked
        self.device = model.device
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.graphs: dict[Bucket, _Captured] = {}
        self.seen: Counter[Bucket] = Counter()  # rounds per bucket that had no graph of their own
        self.captures = 0  # graphs captured (recaptures and failures included)
        self.capture_seconds = 0.0  # the wall time they took, paid by the rounds that needed them
        self.disabled = False  # every round runs eagerly
        self.batched_disabled = False  # rounds of several requests do (lone ones keep their graphs)

    def choose(self, exact: Bucket) -> Bucket:
        """The bucket a round whose own bucket is `exact` replays (get() captures it if new): its
        own once captured; before that, the padded request count's for its first SPECIALIZE_AFTER
        rounds (a count met rarely never gets a graph of its own)."""
        if exact in self.graphs:
            return exact
        self.seen[exact] += 1
        padded = replace(exact, requests=padded_requests(exact.requests, len(self.caches)))
        if padded.tokens > MAX_TOKENS or self.seen[exact] > SPECIALIZE_AFTER:
            return exact
        return padded

    def get(self, bucket: Bucket) -> _Captured | None:
        """The graph of `bucket` (captured now if new), or None when graphs are off."""
        if not self.enabled_for(bucket.requests) or bucket.requests > len(self.caches):
            return None
        for kv in self.caches[: bucket.requests]:
            kv.ensure_staging(bucket.rows, bucket.width)  # may move a staging area
        staging = tuple(kv.staging_generation for kv in self.caches)
        stale = [b for b, c in self.graphs.items() if c.staging != staging[: b.requests]]
        for old in stale:
            del self.graphs[old]  # it writes to an old staging area
        if stale and not self.graphs and self.capture:
            # The pool was released with its last graph; capturing into its handle again is an error.
            self.pool = torch.cuda.graph_pool_handle()
        captured = self.graphs.get(bucket)
        if captured is None:
            began = time.perf_counter()
            captured = self._capture(bucket)
            self.captures += 1
            self.capture_seconds += time.perf_counter() - began
            if captured is None:
                # A lone request's graphs were the first proven on a GPU: a failed batched capture
                # does not take them down.
                if bucket.requests > 1:
                    self.batched_disabled = True
                else:
                    self.disabled = True
                return None
            captured.staging = staging[: bucket.requests]
            self.graphs[bucket] = captured
        return captured

    def enabled_for(self, requests: int) -> bool:
        return not self.disabled and (requests == 1 or not self.batched_disabled)

    def _body(self, captured: _Captured) -> torch.Tensor:
        return graph_body(self.model, self.caches, captured.layout, captured.inputs, self.stacked)

    def _capture(self, bucket: Bucket) -> _Captured | None:
        captured = _Captured(bucket, self.device)
        # Valid inputs for the warm-up run: one token per row, nothing cached.
        captured.inputs[captured.layout.lengths] = 1
        if not self.capture:
            captured.run = lambda: self._body(captured)
            return captured
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side), torch.no_grad():
                self._body(captured)  # warm-up: library handles and workspaces exist before capture
            torch.cuda.current_stream(self.device).wait_stream(side)
            assert captured.graph is not None
            capture = torch.cuda.graph(captured.graph, pool=self.pool, capture_error_mode="thread_local")
            with torch.no_grad(), capture:
                captured.hidden = self._body(captured)
        except RuntimeError as error:
            which = "batched rounds" if bucket.requests > 1 else "this model"
            log.warning("cannot capture a CUDA graph for %s: %s; CUDA graphs are off for %s",
                        bucket, error, which)
            return None
        log.debug("captured a CUDA graph for %s", bucket)
        return captured
