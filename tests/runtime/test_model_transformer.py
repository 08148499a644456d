"""DiffusionLM matches transformers' Qwen2 (same weights) when both attend bidirectionally."""

import pytest
import torch
import torch.nn.functional as F

from lopa.model import DiffusionLM
from lopa.model.attention import attend
from lopa.synthetic import tiny_config
from lopa.synthetic.checkpoint import random_weights


def test_matches_transformers_qwen2_without_causal_mask() -> None:
    transformers = pytest.importorskip("transformers")
    config = tiny_config()
    weights = random_weights(config, seed=5)
    ours = DiffusionLM(config)
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


def _tiny_model(seed: int) -> DiffusionLM:
    config = tiny_config()
    model = DiffusionLM(config)
    model.load_state_dict(random_weights(config, seed=seed), strict=True)
    return model.eval()


def test_fused_projections_compute_the_same_and_share_memory() -> None:
    plain, fused = _tiny_model(8), _tiny_model(8).fuse_projections()
    tokens = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(11)
    with torch.no_grad():
        torch.testing.assert_close(fused(tokens, positions), plain(tokens, positions), rtol=1e-5, atol=1e-5)
    attention = fused.model.layers[0].self_attn
    assert attention.fused_qkv is not None
    storage = attention.fused_qkv[0].untyped_storage().data_ptr()
    assert attention.k_proj.weight.untyped_storage().data_ptr() == storage  # views, not copies
    # state_dict keeps the checkpoint's names and shapes
    assert fused.state_dict()["model.layers.0.self_attn.k_proj.weight"].shape == plain.state_dict()[
        "model.layers.0.self_attn.k_proj.weight"
    ].shape


def test_a_replaced_projection_is_used_instead_of_the_stale_fused_weight() -> None:
    model = _tiny_model(9).fuse_projections()
    tokens = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = model(tokens, torch.arange(6))
        up = model.model.layers[1].mlp.up_proj
        up.weight = torch.nn.Parameter(up.weight.detach() * 2)  # no longer a view of the fused weight
        after = model(tokens, torch.arange(6))
    assert (after - before).abs().max() > 1e-4


def test_rotary_by_roll_equals_rotate_half() -> None:
    from lopa.model.layer_steps import apply_rotary
    from lopa.model.transformer import rotary_cos_sin, signed_sin

    x = torch.randn(2, 5, 3, 8, generator=torch.Generator().manual_seed(6))
    cos, sin = rotary_cos_sin(torch.arange(5).expand(2, 5), 8, 10000.0, torch.float32)
    rotate_half = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)
    expected = x * cos.unsqueeze(2) + rotate_half * sin.unsqueeze(2)
    torch.testing.assert_close(apply_rotary(x, cos, signed_sin(sin)), expected)


def test_output_index_returns_only_those_tokens() -> None:
    model = _tiny_model(10)
    tokens = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        full = model(tokens, torch.arange(7))
        picked = model(tokens, torch.arange(7), output_index=torch.tensor([9, 0, 13]))
    torch.testing.assert_close(picked, full.reshape(14, -1)[[9, 0, 13]])
