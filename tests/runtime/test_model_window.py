"""WindowedLM: incremental forwards equal full recomputes; ragged batches equal rows alone."""

import pytest
import torch

from lopa.model import DiffusionLM, WindowedLM, build_window_mask
from lopa.model.protocol import WindowBatch
from lopa.params import AttentionMode
from lopa.synthetic import tiny_config
from lopa.synthetic.checkpoint import random_weights

PROMPT = 7
BLOCK = 4
BLOCKS = 3
TOTAL = PROMPT + BLOCK * BLOCKS
FULL, BLOCK_CAUSAL = AttentionMode.FULL, AttentionMode.BLOCK_CAUSAL


@pytest.fixture(scope="module")
def model() -> DiffusionLM:
    config = tiny_config()
    model = DiffusionLM(config)
    model.load_state_dict(random_weights(config, seed=7))
    return model.eval()


@pytest.fixture(scope="module")
def sequence() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 97, (TOTAL,), generator=torch.Generator().manual_seed(2))
    blocks = torch.tensor([0] * PROMPT + [1 + i // BLOCK for i in range(BLOCK * BLOCKS)])
    return tokens, blocks


def _batch(tokens, blocks, start, n_stage, mode, lengths=None) -> WindowBatch:
    tokens, blocks = torch.atleast_2d(tokens), torch.atleast_2d(blocks)
    lengths = lengths or [tokens.shape[1]] * tokens.shape[0]
    return WindowBatch(tokens, lengths, blocks, start, n_stage, mode)


def _recompute(model: DiffusionLM, tokens, blocks, mode) -> torch.Tensor:
    """Logits of the whole sequence in one forward, no cache."""
    mask = build_window_mask([tokens.shape[0]], blocks[None], 0, mode)
    with torch.no_grad():
        return model(tokens[None], torch.arange(tokens.shape[0]), mask)[0].float()


def test_block_causal_incremental_equals_recompute(model, sequence) -> None:
    tokens, blocks = sequence
    expected = _recompute(model, tokens, blocks, BLOCK_CAUSAL)
    window = WindowedLM(model, max_length=TOTAL)
    window.reset(1)
    # Round 1: prompt (TO_CACHE) + block 1; then each round caches the previous block.
    start, n_stage = 0, PROMPT
    for end in range(PROMPT + BLOCK, TOTAL + 1, BLOCK):
        logits = window.forward(_batch(tokens[start:end], blocks[start:end], start, n_stage, BLOCK_CAUSAL))
        torch.testing.assert_close(logits[0], expected[start:end], rtol=1e-5, atol=1e-5)
        window.commit(0, n_stage)
        start, n_stage = start + n_stage, BLOCK
    assert window.cache_length() == TOTAL - BLOCK


def test_full_mode_whole_remaining_sequence_equals_recompute(model, sequence) -> None:
    # Exact only because the prompt's K/V were computed seeing the same whole sequence.
    tokens, blocks = sequence
    expected = _recompute(model, tokens, blocks, FULL)
    window = WindowedLM(model, max_length=TOTAL)
    window.reset(1)
    first = window.forward(_batch(tokens, blocks, 0, PROMPT, FULL))
    torch.testing.assert_close(first[0], expected, rtol=1e-5, atol=1e-5)
    window.commit(0, PROMPT)
    rest = window.forward(_batch(tokens[PROMPT:], blocks[PROMPT:], PROMPT, 0, FULL))
    torch.testing.assert_close(rest[0], expected[PROMPT:], rtol=1e-5, atol=1e-5)


def _prefill(window: WindowedLM, tokens, blocks, mode) -> None:
    window.reset(3)
    window.forward(_batch(tokens[:PROMPT], blocks[:PROMPT], 0, PROMPT, mode))
    window.commit(0, PROMPT)


@pytest.mark.parametrize("mode", [FULL, BLOCK_CAUSAL])
@pytest.mark.parametrize(("lengths", "n_stage"), [([12, 5, 9], 4), ([12, 1, 6], 1)])
def test_ragged_batch_equals_rows_alone(model, sequence, mode, lengths, n_stage) -> None:
    tokens, blocks = sequence
    window = WindowedLM(model, max_length=TOTAL)
    _prefill(window, tokens, blocks, mode)
    rows, length = len(lengths), max(lengths)
    # Row r: a different branch (its own tokens), padded after lengths[r] with junk tokens/blocks.
    generator = torch.Generator().manual_seed(3)
    batch_tokens = torch.randint(0, 97, (rows, length), generator=generator)
    batch_blocks = blocks[PROMPT : PROMPT + length].repeat(rows, 1)
    for r, n in enumerate(lengths):
        batch_tokens[r, n:] = 100
        batch_blocks[r, n:] = 0
    batched = window.forward(_batch(batch_tokens, batch_blocks, PROMPT, n_stage, mode, lengths))
    assert not torch.isnan(batched).any()  # padded positions included
    staged = [[t.clone() for t in window.kv.staged(r, layer)] for r in range(rows) for layer in range(2)]

    for r, n in enumerate(lengths):
        _prefill(window, tokens, blocks, mode)
        alone = window.forward(_batch(batch_tokens[r, :n], batch_blocks[r, :n], PROMPT, n_stage, mode))
        torch.testing.assert_close(batched[r, :n], alone[0], rtol=1e-5, atol=1e-5)
        for layer in range(2):
            for got, want in zip(staged[r * 2 + layer], window.kv.staged(0, layer), strict=True):
                assert got.shape[0] == n_stage
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_staged_kv_is_each_rows_own_and_commit_appends_it(model, sequence) -> None:
    tokens, blocks = sequence
    window = WindowedLM(model, max_length=TOTAL)
    _prefill(window, tokens, blocks, FULL)
    two = torch.stack([tokens[PROMPT : PROMPT + 8], tokens[PROMPT : PROMPT + 8].flip(0)])
    window.forward(_batch(two, blocks[PROMPT : PROMPT + 8].repeat(2, 1), PROMPT, BLOCK, FULL))
    k0, _ = window.kv.staged(0, 1)
    k1, v1 = window.kv.staged(1, 1)
    assert not torch.allclose(k0, k1)
    window.commit(1, BLOCK)
    assert window.cache_length() == PROMPT + BLOCK
    cached_k, cached_v = window.kv.cached(1)
    assert torch.equal(cached_k[PROMPT:], k1) and torch.equal(cached_v[PROMPT:], v1)


def test_forward_rejects_inconsistent_batches(model, sequence) -> None:
    tokens, blocks = sequence
    window = WindowedLM(model, max_length=TOTAL)
    window.reset(1)
    with pytest.raises(ValueError, match="cache length"):
        window.forward(_batch(tokens[:4], blocks[:4], 3, 0, FULL))
    with pytest.raises(ValueError, match="n_stage"):
        window.forward(_batch(tokens[:4], blocks[:4], 0, 4, FULL, lengths=[3]))
    with pytest.raises(ValueError, match="max_length"):
        window.forward(_batch(torch.cat([tokens, tokens[:1]]), torch.cat([blocks, blocks[:1]]), 0, 0, FULL))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        WindowedLM(model, max_length=10_000)


def test_bfloat16_forward_is_close_to_float32(model, sequence) -> None:
    tokens, blocks = sequence
    low = DiffusionLM(model.config).to(torch.bfloat16)
    low.load_state_dict(model.state_dict())
    outputs = []
    for m in (model, low):
        window = WindowedLM(m, max_length=TOTAL)
        window.reset(1)
        window.forward(_batch(tokens[:PROMPT], blocks[:PROMPT], 0, PROMPT, FULL))
        window.commit(0, PROMPT)
        outputs.append(window.forward(_batch(tokens[PROMPT:], blocks[PROMPT:], PROMPT, 0, FULL)))
    assert outputs[1].dtype == torch.float32 and not torch.isnan(outputs[1]).any()
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0.05)
