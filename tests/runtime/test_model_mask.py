"""window_mask / build_window_mask: which keys each query of a (row-folded) verification forward sees."""

import torch

from lopa.model import build_window_mask
from lopa.model.mask import additive, additive_window_mask, row_masks, window_mask, window_masks
from lopa.params import AttentionMode


def _ids(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


def _row_view(mask: torch.Tensor, rows: int, cache: int) -> torch.Tensor:
    """[R, query, R', key] view of the window part of a folded mask."""
    window = mask[0, 0, :, cache:]
    length = window.shape[0] // rows
    return window.reshape(rows, length, rows, length)


def test_full_mode_sees_cache_and_whole_window() -> None:
    mask = build_window_mask([4], _ids([1, 1, 2, 2]), cache_length=3, mode=AttentionMode.FULL)
    assert mask.shape == (1, 1, 4, 7)
    assert mask.dtype == torch.bool
    assert mask.all()


def test_block_causal_sees_earlier_and_own_blocks_only() -> None:
    mask = build_window_mask([5], _ids([0, 0, 1, 1, 2]), cache_length=2, mode="block_causal")[0, 0]
    assert mask[:, :2].all()  # cached keys: every query
    expected_window = torch.tensor(
        [
            [1, 1, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0],
            [1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask[:, 2:], expected_window)


def test_rows_see_the_cache_and_only_their_own_window() -> None:
    mask = build_window_mask([3, 3], _ids([1, 1, 1], [1, 1, 1]), cache_length=2, mode="full")
    assert mask.shape == (1, 1, 6, 8)
    assert mask[0, 0, :, :2].all()
    rows = _row_view(mask, 2, 2)
    assert rows[0, :, 0].all() and rows[1, :, 1].all()
    assert not rows[0, :, 1].any() and not rows[1, :, 0].any()


def test_padding_keys_are_masked_per_row() -> None:
    mask = build_window_mask([4, 2], _ids([1, 1, 1, 1], [1, 1, 1, 1]), cache_length=1, mode="full")
    assert mask[0, 0, :, 0].all()
    rows = _row_view(mask, 2, 1)
    assert rows[0, :, 0].all()
    # row 1: valid queries see keys 0..1 only (plus the cache)
    assert torch.equal(rows[1, :2, 1], torch.tensor([[1, 1, 0, 0]] * 2, dtype=torch.bool))


def test_padded_queries_see_themselves() -> None:
    # Row 1 has one valid token; its padded queries keep the diagonal so no softmax row is empty.
    for mode in AttentionMode:
        mask = build_window_mask([3, 1], _ids([1, 1, 2], [1, 9, 9]), cache_length=0, mode=mode)
        assert torch.equal(mask[0, 0].diagonal(), torch.ones(6, dtype=torch.bool))
        assert mask.any(dim=-1).all()
        row1 = _row_view(mask, 2, 0)[1, :, 1]
        assert not row1[0, 1:].any()  # the valid query never sees padding


def test_block_causal_padding_and_blocks_combine() -> None:
    mask = build_window_mask([3], _ids([1, 2, 2, 0]), cache_length=0, mode="block_causal")[0, 0]
    expected = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0], [0, 0, 0, 1]],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


def test_cache_width_past_the_length_is_masked() -> None:
    # A captured graph reads a fixed cache width: positions past the cache length are invisible.
    mask = build_window_mask([2], _ids([1, 1]), cache_length=3, mode="full", cache_width=5)
    assert mask.shape == (1, 1, 2, 7)
    assert mask[0, 0, :, :3].all() and not mask[0, 0, :, 3:5].any()
    assert mask[0, 0, :, 5:].all()


def test_tensor_inputs_give_the_same_mask() -> None:
    lengths, ids = [3, 2], _ids([0, 1, 1], [1, 2, 0])
    for mode in AttentionMode:
        expected = build_window_mask(lengths, ids, cache_length=4, mode=mode, cache_width=6)
        got = window_mask(
            torch.tensor(lengths), ids, torch.tensor(4), 6, torch.tensor(mode is AttentionMode.BLOCK_CAUSAL)
        )
        assert torch.equal(got, expected)


def test_additive_mask_is_zero_or_minus_infinity() -> None:
    mask = build_window_mask([2, 1], _ids([1, 1], [1, 1]), cache_length=1, mode="full")
    bias = additive(mask, torch.bfloat16)
    assert bias.dtype == torch.bfloat16
    assert torch.equal(bias == 0, mask)
    assert torch.isinf(bias[~mask]).all()


def test_memoized_additive_mask_equals_the_built_one() -> None:
    # Same shapes again with a longer cache (a memo hit), ragged rows, both modes, and a window too
    # large to memoize: always exactly additive(build_window_mask(...)).
    cases = [
        ([3, 2], _ids([0, 1, 1], [1, 2, 0])),
        ([4, 4, 1], _ids([1, 1, 2, 2], [1, 1, 2, 2], [1, 9, 9, 9])),
        ([40] * 16, torch.arange(640).view(16, 40) // 8),
    ]
    for lengths, ids in cases:
        for mode in AttentionMode:
            for cache_length in (0, 5, 9):
                expected = additive(build_window_mask(lengths, ids, cache_length, mode), torch.float32)
                got = additive_window_mask(lengths, ids, cache_length, mode, torch.float32)
                assert torch.equal(got, expected), (lengths, mode, cache_length)
                got.fill_(7.0)  # the caller's copy: the memo is not touched


def test_memoized_mask_tells_block_ids_apart_in_block_causal_mode() -> None:
    first = additive_window_mask([3], _ids([1, 1, 2]), 0, "block_causal", torch.float32)
    second = additive_window_mask([3], _ids([1, 2, 2]), 0, "block_causal", torch.float32)
    assert not torch.equal(first, second)
    assert torch.equal(
        additive_window_mask([3], _ids([1, 1, 2]), 0, "full", torch.float32),
        additive_window_mask([3], _ids([1, 2, 2]), 0, "full", torch.float32),
    )


def test_row_masks_are_the_folded_masks_diagonal_blocks() -> None:
    # Row by row (the CPU layout), each row sees the cache and exactly what the folded mask lets it
    # see of its own row: the other rows' keys, always masked there, are simply absent.
    lengths, ids = [4, 2, 3], _ids([1, 1, 2, 2], [1, 2, 9, 9], [2, 1, 1, 9])
    for mode in AttentionMode:
        folded = build_window_mask(lengths, ids, cache_length=3, mode=mode)
        by_row = row_masks(torch.tensor(lengths), ids, 3, mode is AttentionMode.BLOCK_CAUSAL)
        assert by_row.shape == (3, 1, 4, 3 + 4)
        assert by_row[..., :3].all()
        blocks = _row_view(folded, 3, 3)
        for r in range(3):
            assert torch.equal(by_row[r, 0, :, 3:], blocks[r, :, r])
        additive_masks = additive_window_mask(lengths, ids, 3, mode, torch.float32, by_row=True)
        assert torch.equal(additive_masks, additive(by_row, torch.float32))


def test_window_masks_of_several_requests_are_each_requests_window_mask() -> None:
    # A batched CUDA-graph round builds every request's mask at once (lopa.model.cuda_graphs).
    generator = torch.Generator().manual_seed(3)
    lengths = torch.tensor([[4, 2, 3], [1, 4, 4], [3, 3, 1]])
    block_ids = torch.randint(0, 3, (3, 3, 4), generator=generator).sort(dim=2).values
    cache_lengths = torch.tensor([0, 5, 2])
    block_causal = torch.tensor([True, False, True])
    together = window_masks(lengths, block_ids, cache_lengths, 6, block_causal)
    assert together.shape == (3, 1, 12, 18)
    for i in range(3):
        alone = window_mask(lengths[i], block_ids[i], cache_lengths[i], 6, block_causal[i])
        assert torch.equal(together[i : i + 1], alone)
