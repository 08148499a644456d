"""build_window_mask: which keys each query of a verification forward may attend to."""

import torch

from lopa.model import build_window_mask
from lopa.params import AttentionMode


def _ids(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


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


def test_padding_keys_are_masked_per_row() -> None:
    mask = build_window_mask([4, 2], _ids([1, 1, 1, 1], [1, 1, 1, 1]), cache_length=1, mode="full")
    assert mask[0, 0, :, 1:].all()
    # row 1: valid queries see keys 0..1 only (plus the cache)
    assert torch.equal(mask[1, 0, :2, 1:], torch.tensor([[1, 1, 0, 0]] * 2, dtype=torch.bool))
    assert mask[1, 0, :, 0].all()


def test_padded_queries_see_themselves() -> None:
    # Row 1 has one valid token; its padded queries keep the diagonal so no softmax row is empty.
    for mode in AttentionMode:
        mask = build_window_mask([3, 1], _ids([1, 1, 2], [1, 9, 9]), cache_length=0, mode=mode)[1, 0]
        assert torch.equal(mask.diagonal(), torch.ones(3, dtype=torch.bool))
        assert mask.any(dim=-1).all()
        assert not mask[0, 1:].any()  # the valid query never sees padding


def test_block_causal_padding_and_blocks_combine() -> None:
    mask = build_window_mask([3], _ids([1, 2, 2, 0]), cache_length=0, mode="block_causal")[0, 0]
    expected = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0], [0, 0, 0, 1]],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)
