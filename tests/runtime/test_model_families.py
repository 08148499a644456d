"""lopa.model.families: each family's config.json, tensor and module names, and how its checkpoints
load through the public loader; a LLaDA checkpoint against an independent LLaDA forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lopa.model import CheckpointError, ModelConfig, load_model
from lopa.model.families import family_named
from lopa.synthetic import tiny_config
from lopa.synthetic.checkpoint import write_random_checkpoint, write_random_lora_adapter
from lopa.synthetic.tokenizer import write_char_tokenizer

# config.json of GSAI-ML/LLaDA-8B-Instruct, as published.
LLADA_8B = {
    "activation_type": "silu",
    "alibi": False,
    "alibi_bias_max": 8.0,
    "architectures": ["LLaDAModelLM"],
    "attention_dropout": 0.0,
    "attention_layer_norm": False,
    "attention_layer_norm_with_affine": True,
    "auto_map": {
        "AutoConfig": "configuration_llada.LLaDAConfig",
        "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
        "AutoModel": "modeling_llada.LLaDAModelLM",
    },
    "bias_for_layer_norm": False,
    "block_group_size": 1,
    "block_type": "llama",
    "d_model": 4096,
    "embedding_dropout": 0.0,
    "embedding_size": 126464,
    "eos_token_id": 126081,
    "flash_attention": False,
    "include_bias": False,
    "include_qkv_bias": False,
    "init_cutoff_factor": None,
    "init_device": "meta",
    "init_fn": "mitchell",
    "init_std": 0.02,
    "input_emb_norm": False,
    "layer_norm_type": "rms",
    "layer_norm_with_affine": True,
    "mask_token_id": 126336,
    "max_sequence_length": 4096,
    "mlp_hidden_size": 12288,
    "mlp_ratio": 4,
    "model_type": "llada",
    "multi_query_attention": None,
    "n_heads": 32,
    "n_kv_heads": 32,
    "n_layers": 32,
    "pad_token_id": 126081,
    "precision": "amp_bf16",
    "residual_dropout": 0.0,
    "rms_norm_eps": 1e-05,
    "rope": True,
    "rope_full_precision": True,
    "rope_theta": 500000.0,
    "scale_logits": False,
    "transformers_version": "4.46.3",
    "use_cache": False,
    "vocab_size": 126464,
    "weight_tying": False,
}
LLADA_LAYER_0 = {
    "model.transformer.blocks.0.attn_norm.weight",
    "model.transformer.blocks.0.q_proj.weight",
    "model.transformer.blocks.0.k_proj.weight",
    "model.transformer.blocks.0.v_proj.weight",
    "model.transformer.blocks.0.attn_out.weight",
    "model.transformer.blocks.0.ff_norm.weight",
    "model.transformer.blocks.0.ff_proj.weight",
    "model.transformer.blocks.0.up_proj.weight",
    "model.transformer.blocks.0.ff_out.weight",
}


def test_reads_llada_8b_config() -> None:
    config = ModelConfig.from_dict(LLADA_8B)
    assert config.family == "llada" and config.logit_shift == 0 and not config.qkv_bias
    assert (config.hidden_size, config.head_dim, config.num_key_value_heads) == (4096, 128, 32)
    assert (config.intermediate_size, config.num_hidden_layers, config.vocab_size) == (12288, 32, 126464)
    assert (config.rms_norm_eps, config.rope_theta, config.max_position_embeddings) == (1e-5, 5e5, 4096)
    assert (config.mask_token_id, config.eos_token_ids, config.pad_token_id) == (126336, (126081,), 126081)


def test_a_dream_config_is_the_dream_family() -> None:
    config = tiny_config()
    assert config.family == "dream" and config.logit_shift == 1 and config.qkv_bias
    assert ModelConfig.from_dict(json.loads(config.to_json())) == config


def test_llada_config_round_trips_in_its_own_keys(tmp_path: Path) -> None:
    config = tiny_config(family="llada", tie_word_embeddings=True)
    path = tmp_path / "config.json"
    config.to_json(path)
    raw = json.loads(path.read_text())
    assert raw["model_type"] == "llada" and raw["d_model"] == config.hidden_size and raw["weight_tying"]
    assert "hidden_size" not in raw and "num_attention_heads" not in raw
    assert ModelConfig.from_file(path) == config


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"model_type": "llama"}, "model_type 'llama' is not a family lopa knows"),
        ({"model_type": None, "architectures": ["GPT2LMHeadModel"]}, "no model_type"),
        ({"alibi": True}, "alibi=True is not supported"),
        ({"include_bias": True}, "include_bias=True"),
        ({"attention_layer_norm": True}, "attention_layer_norm"),
        ({"activation_type": "gelu"}, "activation_type 'gelu'"),
        ({"d_model": 4095}, r"d_model \(4095\) is not divisible by n_heads"),
        ({"n_kv_heads": 5}, r"n_heads \(32\) is not divisible by n_kv_heads"),
        ({"mask_token_id": 200000}, "mask_token_id"),
        ({"weight_tying": "yes"}, "weight_tying must be true or false"),
    ],
)
def test_a_bad_llada_config_names_the_file_and_field(tmp_path: Path, overrides: dict, named: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in {**LLADA_8B, **overrides}.items() if v is not None}))
    with pytest.raises(CheckpointError, match=named) as info:
        ModelConfig.from_file(path)
    assert info.value.path == str(path)


def test_an_unknown_model_type_lists_the_families() -> None:
    with pytest.raises(CheckpointError, match=r"dream \(model_type Dream\), llada \(model_type llada\)"):
        ModelConfig.from_dict({**LLADA_8B, "model_type": "mistral"})


def test_every_parameter_has_one_llada_name_and_back() -> None:
    llada = family_named("llada")
    config = tiny_config(family="llada")
    from lopa.model.transformer import DiffusionLM

    with torch.device("meta"):
        names = list(DiffusionLM(config).state_dict())
    theirs = [llada.checkpoint_name(name) for name in names]
    top = {"model.transformer.wte.weight", "model.transformer.ln_f.weight", "model.transformer.ff_out.weight"}
    assert set(theirs) >= LLADA_LAYER_0 | top
    assert [llada.lopa_name(name) for name in theirs] == names
    assert llada.lopa_name("model.transformer.blocks.0.o_proj.weight") is None


# -- loading -----------------------------------------------------------------------------------------


def _tensor_names(directory: Path) -> set[str]:
    names: set[str] = set()
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            names |= set(handle.keys())
    return names


def _llada_reference_logits(
    weights: dict[str, torch.Tensor], config: ModelConfig, ids: list[int]
) -> torch.Tensor:
    """LLaDA's forward written from its own description, on its own tensor names: RMSNorm, q/k/v
    without bias, rotate-half RoPE in fp32, full (non-causal) attention, attn_out; ff_norm,
    ff_out(silu(ff_proj(x)) * up_proj(x)); ln_f and the transformer.ff_out head."""
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps))

    def rotate(x: torch.Tensor) -> torch.Tensor:  # [heads, T, dim]
        positions = torch.arange(x.shape[1], dtype=torch.float32)
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        angles = torch.cat([torch.outer(positions, inv_freq)] * 2, dim=-1)
        first, second = x[..., : dim // 2], x[..., dim // 2 :]
        return x * angles.cos() + torch.cat([-second, first], dim=-1) * angles.sin()

    h = weights["model.transformer.wte.weight"][torch.tensor(ids)]
    for i in range(config.num_hidden_layers):
        w = {k.removeprefix(f"model.transformer.blocks.{i}."): v for k, v in weights.items()}
        x = rms(h, w["attn_norm.weight"])
        q = (x @ w["q_proj.weight"].T).view(-1, heads, dim).transpose(0, 1)
        k = (x @ w["k_proj.weight"].T).view(-1, kv_heads, dim).transpose(0, 1)
        v = (x @ w["v_proj.weight"].T).view(-1, kv_heads, dim).transpose(0, 1)
        k, v = k.repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0)
        attended = torch.softmax(rotate(q) @ rotate(k).transpose(1, 2) / dim**0.5, dim=-1) @ v
        h = h + attended.transpose(0, 1).reshape(len(ids), -1) @ w["attn_out.weight"].T
        x = rms(h, w["ff_norm.weight"])
        gated = torch.nn.functional.silu(x @ w["ff_proj.weight"].T) * (x @ w["up_proj.weight"].T)
        h = h + gated @ w["ff_out.weight"].T
    return rms(h, weights["model.transformer.ln_f.weight"]) @ weights["model.transformer.ff_out.weight"].T


def test_a_llada_checkpoint_loads_and_runs_as_llada(tmp_path: Path) -> None:
    config = tiny_config(family="llada")
    weights = write_random_checkpoint(tmp_path, config, shards=2, seed=4)
    assert _tensor_names(tmp_path) >= LLADA_LAYER_0
    assert not any(name.endswith(".bias") for name in _tensor_names(tmp_path))
    loaded = load_model(tmp_path, dtype="float32")
    assert loaded.config == config and loaded.model.model.layers[0].self_attn.q_proj.bias is None
    ids = [5, 17, 42, 8, 23, 61, 100, 100, 100]
    with torch.no_grad():
        ours = loaded.model(torch.tensor([ids]), torch.arange(len(ids)))[0].float()
    reference = _llada_reference_logits(weights, config, ids)
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)


def test_a_missing_llada_tensor_is_named_as_the_file_names_it(tmp_path: Path) -> None:
    config = tiny_config(family="llada")
    weights = write_random_checkpoint(tmp_path, config)
    del weights["model.transformer.blocks.1.ff_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    missing = r"missing tensor model\.transformer\.blocks\.1\.ff_proj\.weight"
    with pytest.raises(CheckpointError, match=missing):
        load_model(tmp_path)


def test_a_dream_tensor_in_a_llada_checkpoint_is_unexpected(tmp_path: Path) -> None:
    config = tiny_config(family="llada")
    weights = write_random_checkpoint(tmp_path, config)
    weights["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(config.hidden_size)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.0\.self_attn\.q_proj\.bias"):
        load_model(tmp_path)


def test_the_llada_d2f_lora_merges_under_its_own_module_names(tmp_path: Path) -> None:
    config = tiny_config(family="llada")
    weights = write_random_checkpoint(tmp_path / "base", config, seed=2)
    adapter = write_random_lora_adapter(tmp_path / "lora", config, r=4, alpha=8.0)
    targets = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())["target_modules"]
    assert targets == ["q_proj", "k_proj", "v_proj", "attn_out"]
    prefix = "base_model.model.model.transformer.blocks.1.attn_out"
    a, b = adapter[f"{prefix}.lora_A.weight"], adapter[f"{prefix}.lora_B.weight"]
    merged = load_model(tmp_path / "base", tmp_path / "lora", dtype="float32").model
    expected = weights["model.transformer.blocks.1.attn_out.weight"] + 2.0 * (b @ a)
    torch.testing.assert_close(merged.model.layers[1].self_attn.o_proj.weight, expected)


def test_a_lora_with_another_familys_modules_is_refused_naming_them(tmp_path: Path) -> None:
    write_random_checkpoint(tmp_path / "base", tiny_config(family="llada"))
    write_random_lora_adapter(tmp_path / "lora", tiny_config(), targets=("q_proj", "o_proj"))  # Dream's names
    foreign = r"model\.layers\.0\.self_attn\.(q|o)_proj is not a module of the llada model"
    with pytest.raises(CheckpointError, match=foreign):
        load_model(tmp_path / "base", tmp_path / "lora")


def test_llada_special_tokens_come_from_its_family(tmp_path: Path) -> None:
    """Without mask_token_id the mask is <|mdm_mask|>; <|eot_id|> ends an answer where the chat
    template closes a turn with it."""
    from lopa.model.special_ids import resolve_special_ids
    from lopa.model.tokenizer import load_tokenizer

    config = tiny_config(family="llada", mask_token_id=None)
    template = "{% for m in messages %}{{ m['content'] }}<|eot_id|>{% endfor %}"
    write_char_tokenizer(tmp_path, chat_template=template)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):  # no declared mask token
        declared = json.loads((tmp_path / name).read_text())
        (tmp_path / name).write_text(json.dumps({k: v for k, v in declared.items() if k != "mask_token"}))
    tokenizer = load_tokenizer(tmp_path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|mdm_mask|>", "<|eot_id|>"]})
    mask, eot = tokenizer.convert_tokens_to_ids(["<|mdm_mask|>", "<|eot_id|>"])
    special = resolve_special_ids(config, tokenizer, tmp_path)
    assert special.mask == mask and special.eos == (*config.eos_token_ids, eot)
    tokenizer.chat_template = None
    assert resolve_special_ids(config, tokenizer, tmp_path).eos == config.eos_token_ids


# The chat templates the Instruct checkpoints ship: LLaDA-8B-Instruct's (Llama 3's) and a Qwen2 one
# as Dream-Instruct's.
LLADA_CHAT = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
)
QWEN2_CHAT = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_an_instruct_checkpoint_chats_through_its_own_template(tmp_path: Path, family: str) -> None:
    """System and user turns render through the checkpoint's template, special tokens as single
    ids, and its end-of-turn token ends the answer."""
    from lopa.model.special_ids import resolve_special_ids
    from lopa.model.tokenizer import chat_ids, load_tokenizer

    template = LLADA_CHAT if family == "llada" else QWEN2_CHAT
    write_char_tokenizer(tmp_path, chat_template=template)
    tokenizer = load_tokenizer(tmp_path)
    extra = ["<|startoftext|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tokenizer.add_special_tokens({"bos_token": "<|startoftext|>", "additional_special_tokens": extra})
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    ids = chat_ids(tokenizer, messages)
    text = tokenizer.decode(ids)
    if family == "llada":
        turn_end = "<|eot_id|>"
        expected = (
            "<|startoftext|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        )
    else:
        turn_end = "<|im_end|>"
        expected = (
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        )
    assert text == expected
    assert ids.count(tokenizer.convert_tokens_to_ids(turn_end)) == 2  # one id per special token
    special = resolve_special_ids(tiny_config(family=family), tokenizer, tmp_path)
    assert tokenizer.convert_tokens_to_ids(turn_end) in special.eos
