"""DreamModel matches transformers' Qwen2 (same weights) when both attend bidirectionally."""

import pytest
import torch
import torch.nn.functional as F

from lopa.model import DreamModel
from lopa.model.dream import attend
from lopa.testing import tiny_config
from lopa.testing.checkpoint import random_weights


def test_matches_transformers_qwen2_without_causal_mask() -> None:
    transformers = pytest.importorskip("transformers")
    config = tiny_config()
    weights = random_weights(config, seed=5)
    ours = DreamModel(config)
    ours.load_state_dict(weights, strict=True)
    reference_config = transformers.Qwen2Config(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    reference = transformers.Qwen2ForCausalLM(reference_config)
    missing, unexpected = reference.load_state_dict(weights, strict=False)
    assert not unexpected
    assert all("rotary" in name for name in missing)

    tokens = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(5, 14)  # absolute positions, as after a cached prefix
    everything = torch.zeros(2, 1, 9, 9)  # additive 4D mask: nothing masked, i.e. no causal mask
    with torch.no_grad():
        expected = reference(
            input_ids=tokens, position_ids=positions.expand(2, 9), attention_mask=everything
        ).logits
        got = ours(tokens, positions)
        causal = ours(tokens, positions, torch.ones(9, 9, dtype=torch.bool).tril())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (causal - got).abs().max() > 1e-3  # and the mask is honoured


def test_gqa_native_and_repeated_kv_agree() -> None:
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 5, 8, generator=generator)
    k, v = torch.randn(2, 2, 2, 7, 8, generator=generator)
    mask = torch.rand(2, 1, 5, 7, generator=generator) > 0.3
    mask[..., 0] = True
    native = attend(q, k, v, mask)
    repeated = F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), attn_mask=mask
    )
    torch.testing.assert_close(native, repeated)
    # head 3 uses KV head 1
    alone = attend(q[:, 3:4], k[:, 1:2], v[:, 1:2], mask)
    torch.testing.assert_close(native[:, 3:4], alone)
