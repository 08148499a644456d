"""KVCache: staging slots, commits, and the pack/append round trip used by distributed commits."""

import pytest
import torch

from lopa.model import KVCache

LAYERS, HEADS, DIM = 3, 2, 4


def _cache(max_length: int = 40) -> KVCache:
    return KVCache(LAYERS, HEADS, DIM, max_length, dtype=torch.float32, num_slots=2)


def _stage(cache: KVCache, rows: int, length: int, n: int, seed: int) -> list[torch.Tensor]:
    """Stage random K/V for `rows` rows; return per-layer keys [R, L, H, D] (values = -keys)."""
    generator = torch.Generator().manual_seed(seed)
    cache.begin_stage(rows, n)
    keys = []
    for layer in range(LAYERS):
        k = torch.randn(rows, length, HEADS, DIM, generator=generator)
        cache.stage(layer, k, -k)
        keys.append(k)
    return keys


def test_stage_and_commit() -> None:
    cache = _cache()
    cache.reset(2)
    keys = _stage(cache, rows=2, length=9, n=5, seed=0)
    assert cache.staged_count(1) == 5
    cache.commit(1, 3)  # a prefix of the staged tokens is allowed
    assert cache.length == 3
    assert cache.staged_count(0) == cache.staged_count(1) == 0  # a commit consumes the staging
    for layer in range(LAYERS):
        k, v = cache.cached(layer)
        assert torch.equal(k, keys[layer][1, :3]) and torch.equal(v, -keys[layer][1, :3])
    with pytest.raises(ValueError, match="staged"):
        cache.commit(0, 6)


def test_pack_append_round_trip() -> None:
    source, target = _cache(), _cache()
    source.reset(2)
    target.reset(1)
    _stage(source, rows=2, length=6, n=6, seed=1)
    target.append_packed(source.pack_staged(0, 6), 6)
    source.commit(0, 6)  # both caches hold the same prefix now

    keys = _stage(source, rows=2, length=8, n=4, seed=2)
    packed = source.pack_staged(1, 4)
    assert packed.is_contiguous() and packed.shape == source.packed_shape(4)
    target.append_packed(packed.clone(), 4)
    source.commit(1, 4)
    assert target.length == source.length == 10
    assert torch.equal(target.cache[:, :, :10], source.cache[:, :, :10])
    assert torch.equal(target.cached(2)[0][6:], keys[2][1, :4])
    with pytest.raises(ValueError, match="shape"):
        target.append_packed(packed, 3)


def test_slots_and_capacity_grow_and_limits_hold() -> None:
    cache = _cache(max_length=100)
    cache.reset(5)
    assert cache.num_slots == 5
    _stage(cache, rows=7, length=70, n=70, seed=3)  # more rows and a longer stage than allocated
    assert cache.num_slots == 7 and cache.staging_capacity >= 70
    cache.commit(6, 70)
    with pytest.raises(ValueError, match="max_length"):
        cache.begin_stage(1, 31)
    cache.reset(1)
    assert cache.length == 0 and cache.staged_count(0) == 0


def test_folded_rows_stage_into_their_own_slots() -> None:
    # A forward folds its rows into one sequence: stage() gets [1, R * L, ...] and splits it per row.
    cache = _cache()
    cache.begin_stage(2, 3)
    keys = torch.randn(1, 2 * 5, HEADS, DIM, generator=torch.Generator().manual_seed(4))
    cache.stage(0, keys, -keys)
    assert torch.equal(cache.staged(0, 0)[0], keys[0, :3])
    assert torch.equal(cache.staged(1, 0)[0], keys[0, 5:8])


def test_stage_rows_writes_whole_rows_and_mark_staged_records_the_real_count() -> None:
    # What a CUDA graph does: stage every token of the padded rows, then record the TO_CACHE count.
    cache = _cache()
    cache.ensure_staging(2, 6)
    cache.stage_rows(2, 6)
    keys = torch.randn(2, 6, HEADS, DIM, generator=torch.Generator().manual_seed(5))
    cache.stage(1, keys, -keys)
    assert cache.staged_count(0) == 0  # nothing recorded yet
    cache.mark_staged(2, 4)
    assert cache.staged_count(1) == 4
    assert torch.equal(cache.staged(1, 1)[0], keys[1, :4])


def test_truncate_forgets_committed_positions() -> None:
    cache = _cache()
    keys = _stage(cache, rows=1, length=6, n=6, seed=6)
    cache.commit(0, 6)
    cache.truncate(2)
    assert cache.length == 2
    assert torch.equal(cache.cached(0)[0], keys[0][0, :2])
    assert cache.cached(0, width=6)[0].shape[0] == 6  # a fixed-width read (masked past the length)
    with pytest.raises(ValueError, match="cannot truncate to 3: the cache holds 2"):
        cache.truncate(3)


def test_a_lone_row_longer_than_the_staging_stages_into_the_cache() -> None:
    # A prompt's first round: one row, more TO_CACHE tokens than a staging slot holds. The staging
    # area keeps its size (it is slots x capacity); the row's K/V go where its commit puts them.
    cache, reference = _cache(max_length=200), _cache(max_length=200)
    cache.reset(4)
    size = cache._staging.numel()
    reference.ensure_staging(1, 150)  # the same forward through an ordinary slot
    keys = _stage(cache, rows=1, length=150, n=150, seed=7)
    _stage(reference, rows=1, length=150, n=150, seed=7)
    assert cache._staging.numel() == size and cache.staging_capacity < 150
    assert cache.length == 0 and cache.staged_count(0) == 150
    assert torch.equal(cache.staged(0, 2)[0], keys[2][0])
    assert torch.equal(cache.pack_staged(0, 150), reference.pack_staged(0, 150))
    cache.commit(0, 120)  # a prefix, as always
    reference.commit(0, 120)
    assert cache.length == 120 and torch.equal(cache.cache[:, :, :120], reference.cache[:, :, :120])
    # The next forwards stage into the slots again, whatever the row count.
    keys = _stage(cache, rows=2, length=9, n=5, seed=8)
    cache.commit(0, 5)
    assert torch.equal(cache.cached(1)[0][120:], keys[1][0, :5])


def test_rows_forwarded_one_at_a_time_keep_slot_0_in_the_cache() -> None:
    # The reference executor forwards row by row (first_slot = row): row 1 must not make slot 0's
    # K/V, staged in the cache, be read from the staging slot.
    cache = _cache(max_length=200)
    generator = torch.Generator().manual_seed(9)
    staged = []
    for row in range(2):
        cache.begin_stage(1, 100, first_slot=row)
        k = torch.randn(1, 100, HEADS, DIM, generator=generator)
        for layer in range(LAYERS):
            cache.stage(layer, k, -k)
        staged.append(k)
    assert torch.equal(cache.staged(0, 0)[0], staged[0][0])
    assert torch.equal(cache.staged(1, 0)[0], staged[1][0])
    cache.commit(0, 100)
    assert torch.equal(cache.cached(0)[0], staged[0][0])


def test_caches_stored_in_one_tensor_commit_into_their_own_slice() -> None:
    # How WindowedLM stores its caches: a batched CUDA-graph round reads them all at once.
    stacked = torch.zeros(2, LAYERS, 2, 40, HEADS, DIM)
    first, second = (
        KVCache(LAYERS, HEADS, DIM, 40, num_slots=2, storage=stacked[index]) for index in range(2)
    )
    keys = _stage(second, rows=2, length=6, n=3, seed=7)
    second.commit(1, 3)
    assert torch.equal(stacked[1, :, 0, :3], torch.stack([k[1, :3] for k in keys]))
    assert first.length == 0 and not stacked[0].any()
    with pytest.raises(ValueError, match=r"KV storage is \(3, 2, 40, 2, 4\).*expected \(3, 2, 41, 2, 4\)"):
        KVCache(LAYERS, HEADS, DIM, 41, storage=stacked[0])


def test_rows_staged_in_a_shared_buffer_commit_and_pack_from_there() -> None:
    # A batched graph round stages every request's rows in one buffer [layers, 2, requests, rows,
    # width, heads, dim]; stage_from points a cache at its request's part.
    generator = torch.Generator().manual_seed(11)
    buffer = torch.randn(LAYERS, 2, 2, 4, 8, HEADS, DIM, generator=generator)
    cache, other = _cache(), _cache()
    cache.reset(1)  # fewer slots of its own than the round's rows
    cache.stage_from(buffer[:, :, 1], rows=3, n=5)
    assert cache.stages_in(buffer) and not other.stages_in(buffer)
    assert cache.staged_count(2) == 5
    keys, values = cache.staged(2, layer=1)
    assert torch.equal(keys, buffer[1, 0, 1, 2, :5]) and torch.equal(values, buffer[1, 1, 1, 2, :5])
    assert torch.equal(cache.pack_staged(2, 5), buffer[:, :, 1, 2, :5])
    cache.commit(2, 5)
    assert cache.length == 5 and torch.equal(cache.cache[:, :, :5], buffer[:, :, 1, 2, :5])
    assert not cache.stages_in(buffer)  # a commit consumes what was staged
    cache.stage_from(buffer[:, :, 1], rows=3, n=5)
    cache.begin_stage(1, 2)  # its own staging again: the buffer's rows are forgotten, every one
    assert not cache.stages_in(buffer) and cache.staged_count(0) == 2 and cache.staged_count(2) == 0
    cache.stage_from(buffer[:, :, 0], rows=2, n=3)
    cache.discard_staged()
    with pytest.raises(ValueError, match="staged tokens"):
        cache.commit(1, 3)
    with pytest.raises(ValueError, match="4 rows of 9 tokens in a source of 4 x 8"):
        cache.stage_from(buffer[:, :, 0], rows=4, n=9)
    with pytest.raises(ValueError, match="stage_from: staged K/V of shape"):
        cache.stage_from(buffer[:1, :, 0], rows=1, n=1)
