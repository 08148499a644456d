"""WindowedLM: the `WindowModel` protocol over a DiffusionLM and static KV caches.

A forward folds its rows into one token sequence for the linear products. Attention: on an
accelerator the rows attend as that one sequence (lopa.model.mask), so every row reads the shared
cache once; on CPU row by row, so a row's bits do not depend on the rows beside it.

The model holds `max_batch` sequences (one KV cache each, allocated up front: the memory is known
at start). `forward_many` runs several sequences' verification forwards as ONE ragged forward: all
their rows folded into one token sequence, every linear product over all of them at once,
attention per sequence (its own cache, its own masks).

On CUDA a round (a lone forward or a ragged one) is replayed from a captured graph
(lopa.model.cuda_graphs) whenever the caller names the outputs it needs (the executors always do);
otherwise, or when it is too large for a graph, it runs eagerly. The graph of R requests reads the
first R physical caches, so the round's requests are moved there first (`_place_front`): `caches`
maps each sequence to the physical cache that holds it, and a move exchanges two caches' committed
prefixes and their places in that map.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from lopa import performance
from lopa.host.heap import keep_freed_memory
from lopa.kernels.dispatch import KERNELS_ENV
from lopa.kernels.vocab_stats import Stats
from lopa.model.attention import Segment
from lopa.model.cuda_graphs import WindowGraphs
from lopa.model.exact_attention import closed_head, row_spans, same_head
from lopa.model.graph_layout import MAX_LAYOUT_TOKENS, bucket_for
from lopa.model.kv_cache import KVCache, cache_shape
from lopa.model.layer_steps import COMPILE_ENV, compile_wanted, kernels_wanted
from lopa.model.mask import additive_window_mask
from lopa.model.protocol import WindowBatch
from lopa.model.transformer import DiffusionLM
from lopa.params import ConfKind

log = logging.getLogger("lopa.model")

GRAPHS_ENV = performance.ENV["cuda_graphs"]  # eager (0): eager forwards on CUDA
# The graphs' rounds (buckets, packing, compact layout) without capture: each replay runs the body
# eagerly, so a profile attributes every kernel to its op and shapes (slow: for profiling only).
GRAPHS_UNCAPTURED = performance.UNCAPTURED
# Rounds of more linear tokens than cuda_graph_tokens run their bucket's body eagerly instead of a
# captured graph (lopa.model.cuda_graphs.WindowGraphs.captures_bucket); -1: every bucket is captured.
GRAPH_TOKENS_ENV = performance.ENV["cuda_graph_tokens"]
_GRAPH_STAGING = (16, 256)  # staging reserved up front for cache 0 when graphs are on: slots x tokens


def graph_staging(index: int, num_slots: int, max_length: int) -> tuple[int, int]:
    """(slots, tokens) of staging reserved at start for physical cache `index` when graphs are on:
    a lone request's rounds replay over cache 0 (graphs hold its staging's address); batched rounds
    stage in one buffer of their own (WindowGraphs.round_kv), so the other caches reserve none. A
    round too large for a graph runs eagerly and grows its caches' staging on first use, as every
    round does with graphs off: that memory is not reserved."""
    if index > 0:
        return num_slots, 0
    slots, tokens = _GRAPH_STAGING
    return max(slots, num_slots), min(tokens, max_length)


def reserved_staging_tokens(max_batch: int, num_slots: int, max_length: int, graphs: bool) -> int:
    """Staging tokens (slots x capacity, all caches, and the batched rounds' buffer) a window model
    reserves at start."""
    if not graphs:
        return 0
    reserved = (graph_staging(index, num_slots, max_length) for index in range(max_batch))
    return sum(slots * tokens for slots, tokens in reserved) + (MAX_LAYOUT_TOKENS if max_batch > 1 else 0)


def graph_capture_tokens() -> int | None:
    """The cuda_graph_tokens switch (lopa.performance): None when every bucket is captured."""
    tokens = performance.value("cuda_graph_tokens")
    return None if tokens < 0 else tokens


def graphs_wanted(device: torch.device, requested: bool | None) -> bool:
    if device.type != "cuda":
        return False
    if requested is not None:
        return requested
    return performance.value("cuda_graphs") != performance.EAGER


class WindowedLM:
    """Runs verification forwards (see lopa.model.protocol) on a real model of any family."""

    def __init__(
        self,
        model: DiffusionLM,
        max_length: int,
        num_slots: int = 1,
        cuda_graphs: bool | None = None,
        max_batch: int = 1,
    ) -> None:
        # long: the window model's buffers, allocated once together
        config = model.config
        if max_length > config.max_position_embeddings:
            raise ValueError(
                f"max_length {max_length} exceeds max_position_embeddings {config.max_position_embeddings}"
            )
        self.model = model.eval()
        # Read once: the caches are allocated on this device and dtype (each model property read is
        # two module attribute lookups, several per forward).
        self._device, self._dtype = model.device, model.dtype
        self.config = config
        self.vocab_size = config.vocab_size
        self.logit_shift = config.logit_shift  # lopa.model.protocol: which output a position reads
        self.max_length = max_length
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        # Every physical cache is a view of one tensor: a batched CUDA-graph round attends to the
        # first R caches in one call per layer (lopa.model.cuda_graphs.graph_body).
        shape = cache_shape(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, max_length)
        self.kv_storage = torch.zeros((max_batch, *shape), dtype=model.dtype, device=model.device)
        self._physical = [
            KVCache(
                config.num_hidden_layers,
                config.num_key_value_heads,
                config.head_dim,
                max_length,
                dtype=model.dtype,
                device=model.device,
                num_slots=num_slots,
                storage=self.kv_storage[index],
            )
            for index in range(max_batch)
        ]
        self.caches = list(self._physical)  # by sequence: the physical cache that holds it
        self.forwards = {"graph": 0, "eager": 0}  # forward calls by path (a worker exports them)
        self._vocab_pass = self._choose_layer_steps(model)
        self.graphs: WindowGraphs | None = None
        if graphs_wanted(self.device, cuda_graphs):
            # Staging reserved up front: graphs hold its address, growing it means recapturing.
            for index, kv in enumerate(self._physical):
                kv.ensure_staging(*graph_staging(index, num_slots, max_length))
            capture = performance.value("cuda_graphs") != GRAPHS_UNCAPTURED
            self.graphs = WindowGraphs(model, self._physical, self.kv_storage, capture=capture,
                                       capture_tokens=graph_capture_tokens())
        if self.device.type == "cpu":
            keep_freed_memory()  # batched CPU forwards otherwise pay page faults (lopa.host.heap)
            self._choose_cpu_products()

    def _choose_layer_steps(self, model: DiffusionLM) -> bool:
        """How the layers' elementwise steps run, decided at start; whether rounds take the
        vocabulary pass (lopa.kernels.vocab_stats), which goes with the Triton kernels."""
        if compile_wanted(self.device):
            model.compile_steps()  # compiled now on a few tokens: a step that cannot, fails the start
            log.info("%s=1: the layers' elementwise steps run through torch.compile", COMPILE_ENV)
        elif kernels_wanted(self.device):
            model.use_kernels()  # each checked against its reference now: one that fails, fails the start
            log.info("the layers' elementwise steps run as Triton kernels (%s=torch: the torch references)",
                     KERNELS_ENV)
        return kernels_wanted(self.device)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def kv(self) -> KVCache:
        """Sequence 0's cache (a lone request's, as the benchmarks and tests use it)."""
        return self.caches[0]

    @torch.no_grad()
    def _choose_cpu_products(self) -> None:
        """Probe each weight shape's batch-invariant CPU product (lopa.model.invariant) now, ~0.1 s
        for the bundled model, rather than in the first request's forward."""
        self.model(torch.zeros((1, 1), dtype=torch.long), torch.zeros(1, dtype=torch.long))

    def reserved_bytes(self) -> int:
        """Bytes of the KV caches and staging areas allocated so far."""
        graphs = self.graphs.reserved_bytes() if self.graphs is not None else 0
        return sum(kv.reserved_bytes() for kv in self._physical) + graphs

    def graph_captures(self) -> tuple[int, float]:
        """CUDA graphs captured so far and the seconds they took ((0, 0.0) without graphs)."""
        if self.graphs is None:
            return 0, 0.0
        return self.graphs.captures, self.graphs.capture_seconds

    def reset(self, num_slots: int, sequence: int = 0) -> None:
        self._cache(sequence).reset(num_slots)

    def cache_length(self, sequence: int = 0) -> int:
        return self._cache(sequence).length

    @torch.no_grad()
    def forward(self, batch: WindowBatch) -> torch.Tensor:
        self._check(batch)
        if self._replayable([batch]):
            logits = self._replay([batch])
            if logits is not None:
                self.forwards["graph"] += 1
                return logits[0]
        self.forwards["eager"] += 1
        return self._eager(batch)

    @torch.no_grad()
    def forward_many(self, batches: Sequence[WindowBatch]) -> list[torch.Tensor]:
        """Several sequences' forwards (each with its outputs named) as one ragged forward; returns
        each one's [N_i, vocab] logits. On CPU a row's logits are bit-identical to its lone forward
        (lopa.model.invariant); a lone batch takes forward()."""
        if len(batches) == 1:
            return [self.forward(batches[0])]
        if len({b.sequence for b in batches}) != len(batches):
            raise ValueError("forward_many: two batches for one sequence")
        for batch in batches:
            self._check(batch)
            if batch.outputs is None:
                raise ValueError("forward_many: every batch must name its outputs")
        if self._replayable(batches):
            replayed = self._replay(batches)
            if replayed is not None:
                self.forwards["graph"] += 1
                return replayed
        self.forwards["eager"] += 1
        return self._eager_many(batches)

    @property
    def vocab_pass(self) -> bool:
        """Whether forward_many_stats reduces greedy statistics in the vocabulary kernel (a GPU with
        Triton, unless LOPA_KERNELS=torch), rather than the executor from logits."""
        return self._vocab_pass

    @torch.no_grad()
    def forward_many_stats(
        self, batches: Sequence[WindowBatch], reduced: Sequence[tuple[int, ConfKind]]
    ) -> list[tuple[Stats, torch.Tensor]]:
        """forward_many, where each batch's first n outputs (reduced[i] = (n, its Conf kind)) come
        back as their greedy statistics (token, P, Conf) from one pass over the vocabulary
        (DiffusionLM.greedy_stats) rather than as logits; the other outputs' logits beside them."""
        if len({b.sequence for b in batches}) != len(batches):
            raise ValueError("forward_many_stats: two batches for one sequence")
        for batch in batches:
            self._check(batch)
            if batch.outputs is None:
                raise ValueError("forward_many_stats: every batch must name its outputs")
        hidden = self._replay(batches, head=False) if self._replayable(batches) else None
        self.forwards["graph" if hidden is not None else "eager"] += 1
        if hidden is None:
            many = len(batches) > 1
            hidden = self._eager_many(batches, head=False) if many else [self._eager(batches[0], head=False)]
        counts = [n for n, _ in reduced]
        kinds = {conf for _, conf in reduced}
        masked = [h[:n] for h, n in zip(hidden, counts, strict=True)]
        if len(kinds) == 1:  # one pass for the round (the usual case: one Conf kind)
            together = self.model.greedy_stats(torch.cat(masked), kinds.pop())
            stats = list(zip(*(column.split(counts) for column in together), strict=True))
        else:
            stats = [self.model.greedy_stats(m, conf) for m, (_, conf) in zip(masked, reduced, strict=True)]
        rest = [h[n:] for h, n in zip(hidden, counts, strict=True)]
        logits = self.model.logits(torch.cat(rest)).float().split([r.shape[0] for r in rest])
        return list(zip(stats, logits, strict=True))

    def commit(self, slot: int, n: int, sequence: int = 0) -> None:
        self._cache(sequence).commit(slot, n)

    def copy_staged(self, source: int, target: int) -> None:
        """Stage in sequence `target` what the latest forward staged in `source` (both caches empty:
        the same first forward, lopa.execution.twins)."""
        self._cache(target).stage_copy_of(self._cache(source))

    def _cache(self, sequence: int) -> KVCache:
        if not 0 <= sequence < self.max_batch:
            raise ValueError(f"sequence {sequence} outside [0, max_batch={self.max_batch})")
        return self.caches[sequence]

    def _segment(self, batch: WindowBatch, offset: int) -> Segment:
        """The batch's tokens at `offset` of a folded forward, its staging begun: on CPU its rows
        attend row by row, each unpadded (a row's bits then depend on that row alone, see
        lopa.model.exact_attention), elsewhere as one sequence (the cache is read once
        for every row)."""
        kv = self._cache(batch.sequence)
        rows, dtype, device = batch.rows, self._dtype, self._device
        by_row = device.type == "cpu" and rows > 1
        mask = additive_window_mask(
            batch.lengths, batch.block_ids, kv.length, batch.mode, dtype, device, by_row=by_row
        )
        kv.begin_stage(rows, batch.n_stage, batch.first_slot)
        spans = None
        if device.type == "cpu":  # row-exact attention (attend_rows_exact)
            config = self.model.config
            repeat = config.num_attention_heads // config.num_key_value_heads
            head = closed_head(batch)
            shared = head > 0 and same_head(batch, head)
            spans = row_spans(mask, batch.lengths, head, kv.length, repeat, shared_head=shared)
        end = offset + rows * batch.width
        return Segment(offset, end, mask, kv, kv.stage, rows if by_row else 1, spans)

    def _eager_many(self, batches: Sequence[WindowBatch], head: bool = True) -> list[torch.Tensor]:
        device = self.device
        segments, tokens, positions, outputs, counts = [], [], [], [], []
        offset = 0
        for batch in batches:
            assert batch.outputs is not None
            rows, width = batch.rows, batch.width
            end = offset + rows * width
            segments.append(self._segment(batch, offset))
            tokens.append(batch.tokens.reshape(-1))
            positions.append(batch.start + torch.arange(width).repeat(rows))
            outputs.append(torch.tensor(batch.outputs, dtype=torch.long) + offset)
            counts.append(len(batch.outputs))
            offset = end
        out = self.model(
            torch.cat(tokens).to(device).reshape(1, offset),
            torch.cat(positions).to(device),
            output_index=torch.cat(outputs).to(device),
            segments=segments,
            head=head,
        )
        return list((out.float() if head else out).split(counts))

    def _eager(self, batch: WindowBatch, head: bool = True) -> torch.Tensor:
        device = self._device
        rows, width = batch.rows, batch.width
        positions = batch.start + torch.arange(width, device=device)
        if rows > 1:
            positions = positions.repeat(rows)
        outputs = None
        if batch.outputs is not None:
            outputs = torch.tensor(batch.outputs, dtype=torch.long, device=device)
        logits = self.model(
            batch.tokens.to(device).reshape(1, rows * width),
            positions,
            output_index=outputs,
            segments=[self._segment(batch, 0)],
            head=head,
        )
        if not head:
            return logits
        if outputs is None:
            logits = logits.view(rows, width, -1)
        return logits.float()

    def _replayable(self, batches: Sequence[WindowBatch]) -> bool:
        if self.graphs is None or not self.graphs.enabled_for(len(batches)):
            return False
        return all(b.outputs is not None and b.first_slot == 0 for b in batches)

    def _replay(self, batches: Sequence[WindowBatch], head: bool = True) -> list[torch.Tensor] | None:
        """The round from its bucket's graph (request i of the bucket is physical sequence i; a
        padded bucket's requests past the round's are one-token padding), or None when it has no
        graph: too large, or its capture failed. Each batch's logits, or without `head` its outputs'
        final-norm states."""
        assert self.graphs is not None
        bucket = bucket_for(
            max(b.rows for b in batches),
            max(b.width for b in batches),
            max(self.caches[b.sequence].length for b in batches),
            self.max_length,
            len(batches),
            sum(b.rows * b.width for b in batches),
        )
        if bucket is None:
            return None
        physical = self._place_front([b.sequence for b in batches])
        captured = self.graphs.get(self.graphs.choose(bucket))  # maybe a padded request count
        if captured is None:
            return None
        order = sorted(range(len(batches)), key=physical.__getitem__)  # bucket request i = physical i
        ordered = [batches[i] for i in order]
        kvs = self._physical[: len(batches)]
        counts = captured.layout.write(captured.host_inputs().zero_(), ordered, [kv.length for kv in kvs])
        captured.write_inputs()
        hidden = captured.replay()
        bucket = captured.layout.bucket
        if bucket.requests == 1:
            # The graph staged every row of its bucket (padding rows included) over whatever was
            # there: only the round's real rows hold something to commit.
            kvs[0].discard_staged()
            kvs[0].mark_staged(ordered[0].rows, ordered[0].n_stage)
        else:  # in the round's own buffer (padding rows and requests too, where no cache reads)
            self.graphs.stage_round(bucket, kvs, [(batch.rows, batch.n_stage) for batch in ordered])
        begin = captured.layout.outputs
        index = captured.inputs[begin : begin + sum(counts)]
        selected = hidden.index_select(0, index)
        logits = (self.model.logits(selected).float() if head else selected).split(counts)
        out: list[torch.Tensor] = [logits[0]] * len(batches)
        for position, i in enumerate(order):
            out[i] = logits[position]
        return out

    def _place_front(self, sequences: Sequence[int]) -> list[int]:
        """Move these sequences into the first len(sequences) physical caches (what a graph of that
        many requests reads); returns each one's physical index. A move exchanges the committed
        prefixes of two caches (KVCache.exchange) and their places in `caches`."""
        count = len(sequences)
        index = {id(kv): p for p, kv in enumerate(self._physical)}
        physical = [index[id(self.caches[s])] for s in sequences]
        outside = [i for i, p in enumerate(physical) if p >= count]
        free = sorted(set(range(count)) - set(physical))
        for i, target_index in zip(outside, free, strict=True):
            sequence, target = sequences[i], self._physical[target_index]
            source = self.caches[sequence]
            holder = self.caches.index(target)  # the sequence (running or not) that target holds
            source.exchange(target)
            self.caches[sequence], self.caches[holder] = target, source
            physical[i] = target_index
        return physical

    def _check(self, batch: WindowBatch) -> None:
        rows, length = batch.tokens.shape
        kv = self._cache(batch.sequence)
        if batch.start != kv.length:
            raise ValueError(f"window start {batch.start} != cache length {kv.length}")
        if batch.start + length > self.max_length:
            raise ValueError(f"window ends at {batch.start + length} > max_length {self.max_length}")
        if tuple(batch.block_ids.shape) != (rows, length) or len(batch.lengths) != rows:
            raise ValueError("tokens, block_ids and lengths disagree on the batch shape")
        for row, n in enumerate(batch.lengths):
            if not max(1, batch.n_stage) <= n <= length:
                raise ValueError(f"row {row}: length {n} outside [max(1, n_stage={batch.n_stage}), {length}]")
        if batch.outputs is not None and any(not 0 <= i < rows * length for i in batch.outputs):
            raise ValueError(f"outputs must be flat indices in [0, {rows * length})")

