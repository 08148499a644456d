"""Verification rounds replayed as CUDA graphs, one graph per shape bucket.

A 7B forward is ~600 kernels; launched one by one from Python they take longer than the GPU needs
to run them. A graph replays them in one launch. Graphs have static shapes and addresses, so a
round is padded up to a bucket (lopa.model.graph_layout: the cache read to a power of two of at
least CACHE_STEP, the unused tail masked; a lone request's rows and window as a whole; a round of
several requests only for attention, its linear products run on its packed real tokens) and its
inputs are written into that bucket's static buffer: ONE host-to-device copy per round. The graph
covers everything but the lm_head, which runs on the tokens whose logits are needed only.

Every bucket is captured on the round that first needs it (0.1-0.4 s for a 7B), so the fewer
buckets a workload meets, the fewer rounds pay a capture. Hence powers of two for the cache read
(attention over a masked tail costs little beside the linears), and a round of R requests replays
the graph of padded_requests(R) requests. The padding requests have no tokens of their own: they
are one-token rows of attention over an empty cache read, in the physical caches after the
round's; those may hold other sequences, whose committed K/V and staging they never touch.

A round of R requests reads the KV caches of the model's first physical sequences: the window model
moves a round's requests there first (WindowedLM._place_front; a copy of the committed
prefix, only when the running set changed). Request i of the bucket is the one in physical
sequence i; in attention its tokens are the i-th block of rows x width slots, attending only to its
own cache and rows. The physical caches are slices of one tensor and every request of a bucket has
the same padded shape, so a layer attends for all of them in one call (batch = request) and builds
their masks together. Their window K/V are laid out straight into one staging buffer of the round
(`round_kv`, the padded layout of every layer), where each request's commit then reads its winner's
(KVCache.stage_from): no copy per request and layer into each cache's own staging (on an H200,
~8 small kernels per layer of a round of 8), and no staging reserved per cache for batched rounds.
The next batched round overwrites that buffer, so it first forgets what any cache had staged there
(a late commit fails); every round's commits precede the next forward.

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
whole path without a GPU). With `capture_tokens` only the buckets of at most that many linear tokens
are captured; a larger round runs its bucket's body eagerly, the same layout and kernels launched
one by one (LOPA_CUDA_GRAPH_TOKENS, lopa.model.window). Meant for rounds whose kernels keep the GPU
busy longer than the host takes to launch them (a 7B round of ~512 tokens: ~16 ms of kernels, ~1,000
launches): there a graph may save less than the captures of its many buckets cost (not yet
measured on a GPU).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from lopa.model.attention import UniformSegments
from lopa.model.graph_layout import MAX_LAYOUT_TOKENS, Bucket, PackedInputs, padded_requests
from lopa.model.kv_cache import KVCache, cache_shape
from lopa.model.mask import additive, window_masks
from lopa.model.transformer import DiffusionLM

log = logging.getLogger("lopa.model")


class _CacheView:
    """The KVSource of a captured forward: a fixed number of cache positions."""

    def __init__(self, kv: KVCache, width: int) -> None:
        self.kv, self.width = kv, width

    def cached(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv.cached(layer, self.width)


def graph_body(
    model: DiffusionLM,
    caches: Sequence[KVCache],
    layout: PackedInputs,
    ints: torch.Tensor,
    stacked: torch.Tensor,
    round_kv: torch.Tensor | None = None,
) -> torch.Tensor:
    """The hidden states [N, hidden] of the round packed in `ints` (on the model's device; N: the
    bucket's linear tokens), request i over caches[i]; stages every row's K/V: a lone request's in
    its cache's staging, several requests' in `round_kv` (round_staging's layout). Only tensor
    operations: a CUDA graph can capture it. stacked: the tensor whose slice i is caches[i].cache
    (WindowedLM.kv_storage): several requests attend in one call per layer (UniformSegments),
    not one call each."""
    bucket, device = layout.bucket, model.device
    tokens = ints[layout.tokens].view(1, bucket.linear_tokens)
    block_ids = ints[layout.block_ids].view(bucket.requests, bucket.rows, bucket.width)
    lengths = ints[layout.lengths].view(bucket.requests, bucket.rows)
    scalars = ints[layout.scalars : layout.outputs].view(bucket.requests, 3)
    steps = torch.arange(bucket.width, device=device).repeat(bucket.rows)
    positions = (scalars[:, 0:1] + steps).reshape(-1)  # of the padded layout
    slots = ints[layout.slots] if bucket.compact else None
    if slots is not None:
        positions = positions.index_select(0, slots)
    bool_masks = window_masks(lengths, block_ids, scalars[:, 1], bucket.cache_width, scalars[:, 2].bool())
    masks = additive(bool_masks, model.dtype)  # [R, 1, rows x width, cache_width + rows x width]
    if bucket.requests == 1:  # a lone request: one sequence, as its eager forward runs it
        kv = caches[0]
        kv.stage_rows(bucket.rows, bucket.width)
        hidden = model.hidden_states(tokens, positions, masks, _CacheView(kv, bucket.cache_width), kv.stage)
    else:
        if round_kv is None or slots is None:
            raise ValueError("graph_body: a round of several requests is compact, with the round's staging")
        segments = _uniform(masks, stacked, round_kv, bucket, slots)
        hidden = model.hidden_states(tokens, positions, segments=segments)
    return hidden.view(bucket.linear_tokens, -1)


def round_staging(round_kv: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    """The K/V a batched round staged, [layers, 2, requests, rows, width, kv_heads, head_dim]: request
    i's rows are KVCache.stage_from's source for its cache."""
    layers, _, _, kv_heads, head_dim = round_kv.shape
    shape = (layers, 2, bucket.requests, bucket.rows, bucket.width, kv_heads, head_dim)
    return round_kv[:, :, : bucket.tokens].view(shape)


def _uniform(
    masks: torch.Tensor,
    stacked: torch.Tensor,
    round_kv: torch.Tensor,
    bucket: Bucket,
    slots: torch.Tensor,
) -> UniformSegments:
    """The bucket's requests as UniformSegments over the first R slices of `stacked`, staging into
    `round_kv` (slots: each compact token's place in the padded layout)."""
    requests, width, tokens = bucket.requests, bucket.cache_width, bucket.tokens

    def past(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return stacked[:requests, layer, 0, :width], stacked[:requests, layer, 1, :width]

    def staging(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return round_kv[layer, 0, :tokens], round_kv[layer, 1, :tokens]

    return UniformSegments(requests, masks, past, staging, slots)


class _Captured:
    def __init__(self, bucket: Bucket, device: torch.device, capture: bool) -> None:
        self.layout = PackedInputs(bucket)
        self.inputs = torch.zeros(self.layout.size, dtype=torch.long, device=device)
        pinned = device.type == "cuda"
        self.host = torch.zeros(self.layout.size, dtype=torch.long, pin_memory=pinned)
        self.graph = torch.cuda.CUDAGraph() if capture else None  # None: the body runs on every replay
        self.run: Callable[[], torch.Tensor] | None = None  # the body, when not captured
        self.hidden: torch.Tensor | None = None  # [N, hidden] (linear tokens), the graph's static output
        self.staging: tuple[int, ...] = ()  # the generation of the staging area it writes (lone rounds)
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
        if self.run is not None:  # uncaptured: nothing static to keep alive between rounds
            return self.run()
        assert self.graph is not None and self.hidden is not None
        self.graph.replay()
        return self.hidden


class WindowGraphs:
    """Lazily captured graphs of rounds over the model's physical sequences `caches` (the graph of
    R requests reads caches[:R]), keyed by bucket."""

    def __init__(
        self,
        model: DiffusionLM,
        caches: Sequence[KVCache],
        stacked: torch.Tensor,
        capture: bool = True,
        capture_tokens: int | None = None,
    ) -> None:
        """stacked: the tensor the caches are slices of, in order (WindowedLM.kv_storage).
        capture_tokens: rounds of more linear tokens run their bucket's body uncaptured (None: every
        bucket is captured when `capture`)."""
        self.model, self.caches, self.capture = model, list(caches), capture
        self.capture_tokens = capture_tokens
        if len(self.caches) > stacked.shape[0] or not all(
            kv.cache.data_ptr() == stacked[i].data_ptr() and kv.cache.shape == stacked.shape[1:]
            for i, kv in enumerate(self.caches)
        ):
            raise ValueError("WindowGraphs: caches[i] must be slice i of the stacked KV storage")
        self.stacked = stacked
        self.device = model.device
        # Where batched rounds stage every request's window K/V (round_staging): one buffer of the
        # largest layout, at a fixed address, so that a graph writes it in place of a copy per request
        # and layer into each cache's own staging. Allocated at start (its bytes are known up front).
        kv = self.caches[0]
        self.round_kv = (
            torch.zeros(cache_shape(kv.num_layers, kv.kv_heads, kv.head_dim, MAX_LAYOUT_TOKENS),
                        dtype=kv.dtype, device=self.device)
            if len(self.caches) > 1 else None
        )
        self.pool = None  # opened by the first capture (and again after its last graph went)
        self.graphs: dict[Bucket, _Captured] = {}
        self.captures = 0  # graphs captured (recaptures and failures included)
        self.capture_seconds = 0.0  # the wall time they took, paid by the rounds that needed them
        self.disabled = False  # every round runs eagerly
        self.batched_disabled = False  # rounds of several requests do (lone ones keep their graphs)

    def choose(self, exact: Bucket) -> Bucket:
        """The bucket a round whose own bucket is `exact` replays (get() captures it if new): for a
        round of several requests (compact) that of padded_requests(R) requests, so that a
        workload meets few request counts; the padding costs attention only."""
        padded = replace(exact, requests=padded_requests(exact.requests, len(self.caches)))
        if not exact.compact or padded.tokens > MAX_LAYOUT_TOKENS:
            return exact
        return padded

    def get(self, bucket: Bucket) -> _Captured | None:
        """The graph of `bucket` (captured now if new), or None when graphs are off."""
        if not self.enabled_for(bucket.requests) or bucket.requests > len(self.caches):
            return None
        if bucket.requests == 1:  # only a lone round stages in its cache's own area
            self.caches[0].ensure_staging(bucket.rows, bucket.width)  # may move the staging area
        else:
            # Whatever runs next writes round_kv (a replay, or a capture's warm-up even when the
            # capture then fails): what an earlier round staged there is gone. Every round's commits
            # precede the next forward, so this only makes a late commit fail.
            self._forget_round_staging()
        stale = [b for b, c in self.graphs.items() if c.staging != self._staging_of(b)]
        for old in stale:
            del self.graphs[old]  # it writes to an old staging area
        if stale and not any(c.graph is not None for c in self.graphs.values()):
            # The pool was released with its last graph; capturing into its handle again is an error.
            self.pool = None
        captured = self.graphs.get(bucket)
        if captured is None and not self.captures_bucket(bucket):
            captured = self.graphs[bucket] = self._uncaptured(bucket)
            captured.staging = self._staging_of(bucket)
        elif captured is None:
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
            captured.staging = self._staging_of(bucket)
            self.graphs[bucket] = captured
        return captured

    def warm(self, buckets: Sequence[Bucket], seconds: float) -> int:
        """Capture the graphs of these rounds' buckets (each as `choose` maps it) that are not captured
        yet, before any round needs them, for at most `seconds`; returns how many were captured."""
        began, before = time.perf_counter(), self.captures
        for number, exact in enumerate(buckets):
            if time.perf_counter() - began > seconds:
                log.info("graph warm-up stopped after %.0f s, %d of %d buckets done",
                         seconds, number, len(buckets))
                break
            bucket = self.choose(exact)
            wanted = self.enabled_for(bucket.requests) and bucket.requests <= len(self.caches)
            if bucket not in self.graphs and wanted and self.captures_bucket(bucket):
                self.get(bucket)
        return self.captures - before

    def describe(self) -> str:
        """How rounds run, for logs and benchmark headers."""
        how = "captured" if self.capture else "uncaptured"
        if self.capture_tokens is not None:
            how += f" up to {self.capture_tokens} linear tokens, larger rounds eager in the same layout"
        return f"CUDA graphs {how}"

    def _staging_of(self, bucket: Bucket) -> tuple[int, ...]:
        """What a bucket's graph holds the address of: cache 0's staging for a lone round (batched
        rounds stage in round_kv, allocated once)."""
        return (self.caches[0].staging_generation,) if bucket.requests == 1 else ()

    def enabled_for(self, requests: int) -> bool:
        return not self.disabled and (requests == 1 or not self.batched_disabled)

    def captures_bucket(self, bucket: Bucket) -> bool:
        """Whether the bucket's rounds replay a graph captured for it (with capture=False: counted as
        one, its body run on every replay), else its body runs eagerly, counted as no capture."""
        return self.capture_tokens is None or bucket.linear_tokens <= self.capture_tokens

    def _uncaptured(self, bucket: Bucket) -> _Captured:
        captured = _Captured(bucket, self.device, capture=False)
        captured.run = lambda: self._body(captured)
        return captured

    def stage_round(
        self, bucket: Bucket, kvs: Sequence[KVCache], rows_and_counts: Sequence[tuple[int, int]]
    ) -> None:
        """After a batched round's replay: kvs[i] (request i of the bucket) staged its first
        rows_and_counts[i] = (rows, n) tokens in the round's buffer (get() forgot what earlier rounds
        had staged there)."""
        assert self.round_kv is not None
        staged = round_staging(self.round_kv, bucket)
        for i, (kv, (rows, n)) in enumerate(zip(kvs, rows_and_counts, strict=True)):
            kv.stage_from(staged[:, :, i], rows, n)

    def _forget_round_staging(self) -> None:
        if self.round_kv is not None:
            for kv in self.caches:
                if kv.stages_in(self.round_kv):
                    kv.discard_staged()

    def reserved_bytes(self) -> int:
        """Bytes of the batched rounds' staging buffer."""
        return 0 if self.round_kv is None else self.round_kv.numel() * self.round_kv.element_size()

    def _body(self, captured: _Captured) -> torch.Tensor:
        layout, inputs = captured.layout, captured.inputs
        return graph_body(self.model, self.caches, layout, inputs, self.stacked, self.round_kv)

    def _capture(self, bucket: Bucket) -> _Captured | None:
        if not self.capture:  # the stand-in of a capture (CPU tests, profiles)
            return self._uncaptured(bucket)
        captured = _Captured(bucket, self.device, capture=True)
        # Valid inputs for the warm-up run: one token per row, nothing cached.
        captured.inputs[captured.layout.lengths] = 1
        try:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
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
