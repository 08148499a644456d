"""The shapes of graphed rounds (pure): the bucket a round is padded to, and the int64 layout its
inputs are packed in (one host-to-device copy per round). See lopa.model.cuda_graphs.

A lone request's round is padded as a whole: its rows to a power of two, its window to a multiple
of WIDTH_STEP. A round of several requests is COMPACT: the linear products (nearly all of a 7B
forward's FLOPs) run on the real tokens only, packed request after request (rounded up to a few
sizes, compact_tokens), and only attention runs on the padded layout [requests x rows x width],
each request padded to the most rows and the widest window among them. Requests beside each other
differ in rows (one was granted a lookahead, another not) and width (one window spans two blocks,
another one): padded for the linears too, a 7B round of 8 requests computed ~1.5x its tokens
(runtime/BENCHMARKS.md, "Many requests at once on a GPU").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lopa.model.protocol import WindowBatch
from lopa.params import AttentionMode

WIDTH_STEP = 16
CACHE_STEP = 256
MAX_ROWS = 64
MAX_WIDTH = 256  # wider windows (a prefill) gain nothing from a graph: they run eagerly
MAX_TOKENS = 2048  # tokens of the largest captured round's linear products; larger run eagerly
# A compact round's padded attention layout (requests x rows x width) holds at most this many.
MAX_LAYOUT_TOKENS = 4096
# The widest window of a batched round's graph: a prompt-sized window (a request's first round)
# would pad every request of its round to that width in attention, and its bucket would rarely recur.
MAX_BATCHED_WIDTH = 128


@dataclass(frozen=True)
class Bucket:
    rows: int  # per request
    width: int
    cache_width: int
    requests: int = 1
    compact: int = 0  # tokens of the linear products (compact rounds); 0: the padded layout's

    @property
    def request_tokens(self) -> int:
        return self.rows * self.width

    @property
    def tokens(self) -> int:
        """Tokens of the padded layout (attention's; the linears' too unless compact)."""
        return self.requests * self.rows * self.width

    @property
    def linear_tokens(self) -> int:
        return self.compact or self.tokens


def bucket_for(
    rows: int, width: int, cache_length: int, max_length: int, requests: int = 1, tokens: int = 0
) -> Bucket | None:
    """The bucket a round is padded to (rows, width, cache_length: the largest of its requests';
    tokens: all its requests' real tokens, for a round of several), or None when it is too large to
    capture."""
    cache_width = 0 if cache_length <= 0 else min(max_length, max(CACHE_STEP, _power_of_two(cache_length)))
    stepped = -(-width // WIDTH_STEP) * WIDTH_STEP
    if requests == 1:
        bucket = Bucket(_power_of_two(rows), stepped, cache_width)
    else:  # compact: padding costs attention only, so coarse steps (fewer graphs)
        power = max(WIDTH_STEP, _power_of_two(width))
        rows, width = _power_of_two(rows), power if power <= max_length else stepped
        compact = min(requests * rows * width, compact_tokens(tokens))
        bucket = Bucket(rows, width, cache_width, requests, compact)
    return bucket if fits(bucket, max_length) else None


def compact_tokens(tokens: int) -> int:
    """The linear token count of a compact round: a multiple of 64 up to 256, then of 128 (a
    round filled to the branch budget wastes a few %; few sizes, few graphs)."""
    step = 64 if tokens <= 256 else 128
    return max(step, -(-tokens // step) * step)


def fits(bucket: Bucket, max_length: int) -> bool:
    """Whether a graph is captured for this bucket (larger rounds run eagerly)."""
    if bucket.compact:  # several requests
        too_large = bucket.width > MAX_BATCHED_WIDTH or bucket.tokens > MAX_LAYOUT_TOKENS
    else:  # a lone request, padded as a whole
        too_large = bucket.width > MAX_WIDTH
    too_large = too_large or bucket.rows > MAX_ROWS or bucket.linear_tokens > MAX_TOKENS
    return not too_large and bucket.width <= max_length


def padded_requests(requests: int, limit: int) -> int:
    """The request count a round of `requests` replays the graph of: the next of 1, 2, 3, 4, 6,
    8, 12, 16, 24, ... (a power of two or three quarters of one), at most `limit` (the physical
    caches there are). Padding requests have no tokens in a compact round: they cost attention only."""
    power = _power_of_two(requests)
    three_quarters = 3 * power // 4
    return max(requests, min(limit, three_quarters if three_quarters >= requests else power))


def _power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class PackedInputs:
    """The int64 layout of a bucket's inputs: tokens [N] (N = the linear token count), in a compact
    bucket their slots [N] (each one's index in the padded layout), block ids [T] (T: the padded
    layout's tokens), lengths [R x rows], then per request its start, cache length and
    block_causal, then up to N + R x rows output indices into the N tokens (read after the replay).
    Request i's padded rows are the i-th block of the layout; compact, its tokens follow request
    i - 1's."""

    def __init__(self, bucket: Bucket) -> None:
        n, t, r = bucket.linear_tokens, bucket.tokens, bucket.requests * bucket.rows
        self.bucket = bucket
        self.tokens = slice(0, n)
        self.slots = slice(n, 2 * n if bucket.compact else n)
        self.block_ids = slice(self.slots.stop, self.slots.stop + t)
        self.lengths = slice(self.block_ids.stop, self.block_ids.stop + r)
        self.scalars = self.lengths.stop  # per request: start, cache length, block_causal
        self.outputs = self.scalars + 3 * bucket.requests
        self.size = self.outputs + n + r

    def write(
        self, host: torch.Tensor, batches: Sequence[WindowBatch], cache_lengths: Sequence[int]
    ) -> list[int]:
        """Write the round (request i = batches[i], over a cache of cache_lengths[i]) into a zeroed
        `host`; returns each request's output count (its indices follow the previous request's).
        Per request only its tokens and block ids are copied; the other fields are gathered in
        Python and written with one tensor each: small torch calls per request were ~26 us each
        round and request, host time on a GPU's critical path."""
        # long: a round's fields written in one pass, on the GPU's critical path
        bucket = self.bucket
        block_ids = host[self.block_ids].view(bucket.requests, bucket.rows, bucket.width)
        shape = (bucket.requests, bucket.rows, bucket.width)
        padded_tokens = None if bucket.compact else host[self.tokens].view(shape)
        sizes = [batch.rows * batch.width for batch in batches]  # each request's real tokens
        if bucket.compact and sum(sizes) > bucket.compact:
            raise ValueError(f"write: {sum(sizes)} tokens for a bucket of {bucket.compact}")
        lengths = [1] * (bucket.requests * bucket.rows)  # padding rows: one token that sees itself
        scalars: list[int] = []  # per request: start, cache length, block_causal
        outputs: list[int] = []
        counts: list[int] = []
        offset = 0  # compact: where the request's tokens begin
        for i, (batch, cache_length) in enumerate(zip(batches, cache_lengths, strict=True)):
            if padded_tokens is not None:
                padded_tokens[i, : batch.rows, : batch.width] = batch.tokens
            else:
                host[offset : offset + batch.rows * batch.width] = batch.tokens.reshape(-1)
                offset += batch.rows * batch.width
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
        flat = torch.tensor(outputs, dtype=torch.long)  # flat in each caller's [rows, width] layout
        if bucket.compact:
            per_request = torch.tensor(sizes)
            begins = per_request.cumsum(0) - per_request  # where each request's compact tokens begin
            self._write_slots(host, batches, per_request, begins)
            # A request's compact tokens are its own [rows, width] layout, after those before it.
            rebased = begins.repeat_interleave(torch.tensor(counts)) + flat
        else:  # a lone request (a round of several is compact): its block starts the bucket
            if len(batches) != 1:
                raise ValueError(f"write: {len(batches)} requests in a bucket that is not compact")
            width = batches[0].width
            rebased = flat // width * bucket.width + flat % width
        host[self.outputs : self.outputs + flat.numel()] = rebased
        return counts

    def _write_slots(
        self, host: torch.Tensor, batches: Sequence[WindowBatch], sizes: torch.Tensor, begins: torch.Tensor
    ) -> None:
        """Each compact token's index in the padded layout (sizes, begins: each request's count of
        tokens and first one); the padding tokens after the real ones go to one slot no real token
        has (its key is masked for every real query: past a row's length, or a padding row or
        request)."""
        bucket, real = self.bucket, int(sizes.sum())
        widths = torch.tensor([batch.width for batch in batches]).repeat_interleave(sizes)
        blocks = (torch.arange(len(batches)) * bucket.request_tokens).repeat_interleave(sizes)
        within = torch.arange(real) - begins.repeat_interleave(sizes)
        slots = host[self.slots]
        slots[:real] = blocks + within // widths * bucket.width + within % widths
        if real < bucket.compact:
            slots[real:] = self._spare_slot(batches)

    def _spare_slot(self, batches: Sequence[WindowBatch]) -> int:
        bucket = self.bucket
        for i, batch in enumerate(batches):
            block = i * bucket.request_tokens
            if batch.width < bucket.width:
                return block + bucket.width - 1  # past its first row's length
            if batch.rows < bucket.rows:
                return block + batch.rows * bucket.width  # its first padding row
        if len(batches) < bucket.requests:
            return len(batches) * bucket.request_tokens  # a padding request
        raise ValueError("write: padding tokens in a bucket that its real tokens fill")
