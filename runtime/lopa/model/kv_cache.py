"""A preallocated static KV cache with per-slot staging.

Layout: `cache` is [layers, 2 (K/V), max_length, kv_heads, head_dim]; the first `length` positions
hold the committed prefix. Each staging slot (one per batch row) is [layers, 2, capacity, kv_heads,
head_dim] and receives the K/V of its row's first n_stage tokens during a forward; `commit(slot, n)`
appends them to the cache. `pack_staged` / `append_packed` move the same bytes as ONE contiguous
tensor so that a distributed commit is a single broadcast. A commit (either way) consumes the staging
of every slot: pack before committing.

A forward folds its rows into one sequence (see lopa.model.mask): `stage` receives the keys of
all rows as [1, R * L, ...] and splits them per row.

A lone row staging more tokens than the staging area holds (a prompt's first round) stages into
the cache itself, at the positions its commit would copy them to: the staging area is
slots x capacity, so growing it to a prompt's length for one row would reserve that length for
every slot (16 slots of a 2k-token prompt: 1.8 GB for a 7B model, per request's cache).

A batched CUDA-graph round lays every request's window K/V out in one buffer shared by the round
(lopa.model.cuda_graphs); `stage_from` records that a cache's staged rows are there instead, and its
commit or pack reads them from there until the next staging of any kind forgets them.
"""

from __future__ import annotations

import torch

_STAGING_ROUND = 64  # staging capacity grows in steps of this many tokens (fewer reallocations)
_EXCHANGE_CHUNK = 256  # positions swapped at a time by exchange (a bounded temporary)


def cache_shape(num_layers: int, kv_heads: int, head_dim: int, length: int) -> tuple[int, ...]:
    """A cache's layout (and of K/V packed for a commit): [layers, 2 (K/V), length, kv_heads, head_dim]."""
    return (num_layers, 2, length, kv_heads, head_dim)


class KVCache:
    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        max_length: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        num_slots: int = 1,
        storage: torch.Tensor | None = None,
    ) -> None:
        """storage: the cache tensor to use (a view of several caches stacked in one tensor, so a
        batched round attends to all of them at once, see lopa.model.cuda_graphs); else allocated."""
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.max_length = max_length
        self.dtype = dtype
        self.device = torch.device(device)
        shape = self._shape(max_length)
        if storage is None:
            storage = torch.zeros(shape, dtype=dtype, device=self.device)
        elif (tuple(storage.shape), storage.dtype) != (shape, dtype) or not _same_device(
            storage.device, self.device
        ):
            raise ValueError(
                f"KV storage is {tuple(storage.shape)} {storage.dtype} on {storage.device}, "
                f"expected {shape} {dtype} on {self.device}"
            )
        self.cache = storage
        # Each layer's K and V, whole length: what `cached` slices every layer of every forward.
        self._layer_kv = [(storage[layer, 0], storage[layer, 1]) for layer in range(num_layers)]
        self._length = 0
        self._staging = torch.zeros((0, *self._shape(0)), dtype=dtype, device=self.device)
        self._staged: list[int] = []  # tokens staged in each slot by the latest forward
        self._stage_n = 0  # tokens per row that the forward in progress stages
        self._stage_first = 0  # slot of its row 0
        self._stage_rows = 0  # rows of the forward in progress
        self._in_tail = False  # slot 0's staged K/V are in the cache (see above)
        self._external: torch.Tensor | None = None  # staged K/V held elsewhere (stage_from)
        self._stage_in_tail = False  # the forward in progress stages its row into the cache
        self.staging_generation = 0  # bumped whenever the staging area is reallocated (graphs hold it)
        self.ensure_staging(num_slots, 0)

    def _shape(self, length: int) -> tuple[int, ...]:
        return cache_shape(self.num_layers, self.kv_heads, self.head_dim, length)

    @property
    def length(self) -> int:
        return self._length

    def reserved_bytes(self) -> int:
        tensors = (self.cache, self._staging)
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def num_slots(self) -> int:
        return int(self._staging.shape[0])

    @property
    def staging_capacity(self) -> int:
        return int(self._staging.shape[3])

    def reset(self, num_slots: int) -> None:
        """Empty the cache (no zeroing needed: only [0, length) is ever read); ensure num_slots slots."""
        self._length = 0
        self.ensure_staging(num_slots, 0)
        self._forget_staged()

    def ensure_staging(self, num_slots: int, n: int) -> None:
        """Grow the staging area to at least num_slots slots of n tokens, keeping what is staged."""
        if n > self.max_length:
            raise ValueError(f"cannot stage {n} tokens: max_length is {self.max_length}")
        slots, capacity = self.num_slots, self.staging_capacity
        if num_slots <= slots and n <= capacity:
            return
        capacity = max(capacity, min(self.max_length, -(-n // _STAGING_ROUND) * _STAGING_ROUND))
        shape = (max(slots, num_slots), *self._shape(capacity))
        grown = torch.zeros(shape, dtype=self.dtype, device=self.device)
        old = self._staging if hasattr(self, "_staging") else None
        if old is not None:  # rows forwarded one at a time stage into the slots one by one
            grown[: old.shape[0], :, :, : old.shape[3]] = old
        self._staging = grown
        self.staging_generation += 1
        self._staged = self._staged + [0] * (grown.shape[0] - len(self._staged))

    # ---- reads -------------------------------------------------------------------------------

    def cached(self, layer: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the first `width` (default: the committed length) cache positions of `layer`,
        each [width, kv_heads, head_dim]; positions past the length must be masked by the reader."""
        end = self._length if width is None else width
        keys, values = self._layer_kv[layer]
        return keys[:end], values[:end]

    def staged(self, slot: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the K/V staged in `slot` for `layer`, each [n_staged, kv_heads, head_dim]."""
        n = self._staged[slot]
        if self._staged_in_cache(slot):
            tail = slice(self._length, self._length + n)
            return self.cache[layer, 0, tail], self.cache[layer, 1, tail]
        staging = self._staged_area()
        return staging[slot, layer, 0, :n], staging[slot, layer, 1, :n]

    def staged_count(self, slot: int) -> int:
        return self._staged[slot] if 0 <= slot < len(self._staged) else 0

    # ---- staging during a forward ----------------------------------------------------------

    def begin_stage(self, rows: int, n: int, first_slot: int = 0) -> None:
        """Start a forward that stages the first n tokens of row r into slot first_slot + r."""
        if self._length + n > self.max_length:
            raise ValueError(f"staging {n} tokens after {self._length} exceeds max_length {self.max_length}")
        in_tail = rows == 1 and first_slot == 0 and n > self.staging_capacity
        self.ensure_staging(first_slot + rows, 0 if in_tail else n)
        self._leave_external()
        self._stage_n, self._stage_first, self._stage_rows = n, first_slot, rows
        self._stage_in_tail = in_tail
        self.mark_staged(rows, n, first_slot, in_tail)

    def stage_rows(self, rows: int, n: int) -> None:
        """Make `stage` write the first n tokens of rows 0..rows-1 without recording them as staged
        (a CUDA graph stages whole padded rows; mark_staged records the real count afterwards)."""
        self._leave_external()
        self._stage_n, self._stage_first, self._stage_rows = n, 0, rows
        self._stage_in_tail = False

    def stage_from(self, source: torch.Tensor, rows: int, n: int) -> None:
        """Record that rows 0..rows-1 staged their first n tokens in `source` [layers, 2, >= rows,
        >= n, kv_heads, head_dim] (a batched graph round's shared staging; row r is slot r): a
        commit or pack of them reads it there. What this cache had staged is forgotten."""
        layers, pair, capacity_rows, capacity, *head = source.shape
        if (layers, pair, *head) != (self.num_layers, 2, self.kv_heads, self.head_dim):
            raise ValueError(f"stage_from: staged K/V of shape {tuple(source.shape)} for this cache")
        if rows > capacity_rows or n > capacity:
            raise ValueError(
                f"stage_from: {rows} rows of {n} tokens in a source of {capacity_rows} x {capacity}"
            )
        self._forget_staged()
        self._external = source
        self._staged = [n] * rows + [0] * max(0, self.num_slots - rows)

    def stages_in(self, source: torch.Tensor) -> bool:
        """Whether what this cache has staged lies in `source`'s storage (stage_from)."""
        return self._external is not None and (
            self._external.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
        )

    def mark_staged(self, rows: int, n: int, first_slot: int = 0, in_tail: bool = False) -> None:
        """Record that slots first_slot.. hold n staged tokens (after a CUDA graph staged them);
        in_tail: slot 0's are in the cache (rows forwarded one at a time leave slot 0 as it was)."""
        self._leave_external()
        if first_slot == 0:
            self._in_tail = in_tail
        for slot in range(first_slot, first_slot + rows):
            self._staged[slot] = n

    def stage(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values [1, R * L, kv_heads, head_dim] of one layer (rows folded, see the module
        docstring) or [R, L, ...]; the first n tokens of row r go to its slot."""
        rows, n, first = self._stage_rows, self._stage_n, self._stage_first
        if n == 0:
            return
        keys = keys.reshape(rows, -1, self.kv_heads, self.head_dim)
        values = values.reshape(rows, -1, self.kv_heads, self.head_dim)
        if self._stage_in_tail:
            tail = slice(self._length, self._length + n)
            self.cache[layer, 0, tail] = keys[0, :n]
            self.cache[layer, 1, tail] = values[0, :n]
            return
        self._staging[first : first + rows, layer, 0, :n] = keys[:, :n]
        self._staging[first : first + rows, layer, 1, :n] = values[:, :n]

    def stage_copy_of(self, other: KVCache) -> None:
        """Stage what `other` staged, slot for slot, as if this cache had run the same forward: both
        empty (a request's first round; lopa.execution.twins)."""
        if self._length or other._length:
            raise ValueError(f"stage_copy_of: caches of {self._length} and {other._length} tokens, not empty")
        self._forget_staged()
        counts = list(other._staged)
        self.ensure_staging(len(counts), 0 if other._staged_in_cache(0) else max(counts, default=0))
        source = other._staged_area()
        for slot, n in enumerate(counts):
            if not n:
                continue
            if other._staged_in_cache(slot):  # a prompt longer than the staging area: in the cache's tail
                self.cache[:, :, :n] = other.cache[:, :, :n]
                self._in_tail = True
            else:
                self._staging[slot, :, :, :n] = source[slot, :, :, :n]
        self._staged = counts + [0] * (self.num_slots - len(counts))

    # ---- commits -----------------------------------------------------------------------------

    def commit(self, slot: int, n: int) -> None:
        """Append the first n staged tokens of `slot` to the cache."""
        self._check_commit(n)
        if n > self.staged_count(slot):
            raise ValueError(f"slot {slot} holds {self.staged_count(slot)} staged tokens, cannot commit {n}")
        end = self._length + n
        if not self._staged_in_cache(slot):  # else already in place
            self.cache[:, :, self._length : end] = self._staged_area()[slot, :, :, :n]
        self._advance(end)

    def packed_shape(self, n: int) -> torch.Size:
        """Shape of `pack_staged(slot, n)`: what a receiver allocates before a broadcast."""
        return torch.Size(self._shape(n))

    def pack_staged(self, slot: int, n: int) -> torch.Tensor:
        """All layers' K and V of the first n staged tokens of `slot`, as one contiguous tensor."""
        if n > self.staged_count(slot):
            raise ValueError(f"slot {slot} holds {self.staged_count(slot)} staged tokens, cannot pack {n}")
        if self._staged_in_cache(slot):
            return self.cache[:, :, self._length : self._length + n].contiguous()
        return self._staged_area()[slot, :, :, :n].contiguous()

    def append_packed(self, packed: torch.Tensor, n: int) -> None:
        """Inverse of pack_staged: append n tokens' K/V (from any rank) to the cache."""
        self._check_commit(n)
        if packed.shape != self.packed_shape(n):
            expected = tuple(self.packed_shape(n))
            raise ValueError(f"packed K/V has shape {tuple(packed.shape)}, expected {expected}")
        end = self._length + n
        self.cache[:, :, self._length : end] = packed.to(device=self.device, dtype=self.dtype)
        self._advance(end)

    def exchange(self, other: KVCache) -> None:
        """Swap committed prefixes (and lengths) with `other`, a cache of the same shape. The staging
        areas stay where they are (CUDA graphs hold their addresses) and both caches' staged K/V are
        discarded: a round's commits come before the next round's forward, so what is still staged
        then was never to be committed, and a commit after a move raises instead of taking the
        other cache's K/V."""
        if self.cache.shape != other.cache.shape or self.dtype != other.dtype:
            raise ValueError("exchange: caches of different shapes")
        for begin in range(0, max(self._length, other._length), _EXCHANGE_CHUNK):
            chunk = slice(begin, begin + _EXCHANGE_CHUNK)
            kept = other.cache[:, :, chunk].clone()
            other.cache[:, :, chunk] = self.cache[:, :, chunk]
            self.cache[:, :, chunk] = kept
        self._length, other._length = other._length, self._length
        self._forget_staged()
        other._forget_staged()

    def truncate(self, length: int) -> None:
        """Forget the committed positions from `length` on (benchmarks repeat one step this way)."""
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate to {length}: the cache holds {self._length}")
        self._advance(length)

    def _advance(self, end: int) -> None:
        # Staged K/V belong to the window before this commit: consumed, so none can be committed twice.
        self._length = end
        self._forget_staged()

    def discard_staged(self) -> None:
        """Forget what is staged: another forward overwrote the staging (a padded CUDA graph round
        ran over this cache), so a commit of it must fail rather than take that forward's K/V."""
        self._forget_staged()

    def _staged_in_cache(self, slot: int) -> bool:
        return slot == 0 and self._in_tail

    def _staged_area(self) -> torch.Tensor:
        """[slots, layers, 2, tokens, kv_heads, head_dim]: this cache's staging, or stage_from's."""
        return self._staging if self._external is None else self._external.permute(2, 0, 1, 3, 4, 5)

    def _leave_external(self) -> None:
        """Staging in this cache's own area again: every row stage_from recorded is forgotten (a
        count left for a slot the new forward does not write would commit the wrong K/V)."""
        if self._external is not None:
            self._forget_staged()

    def _forget_staged(self) -> None:
        self._staged = [0] * self.num_slots
        self._in_tail = self._stage_in_tail = False
        self._external = None

    def _check_commit(self, n: int) -> None:
        if n < 0 or self._length + n > self.max_length:
            raise ValueError(f"cannot commit {n} tokens after {self._length}: max_length {self.max_length}")


def _same_device(actual: torch.device, wanted: torch.device) -> bool:
    """`wanted` without an index ("cuda") means the current device of its kind."""
    return actual.type == wanted.type and (wanted.index is None or actual.index == wanted.index)
