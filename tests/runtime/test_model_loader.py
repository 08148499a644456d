"""load_model on random checkpoints: weights, tokenizer, special ids, and errors that name the culprit."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lopa.model import CheckpointError, WindowedLM, load_model
from lopa.synthetic import special_token_id, tiny_config, write_random_checkpoint, write_random_lora_adapter


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    directory = tmp_path_factory.mktemp("single")
    return directory, write_random_checkpoint(directory, tiny_config(), seed=1)


@pytest.mark.parametrize("shards", [1, 3])
def test_loads_weights_config_and_tokenizer(tmp_path: Path, shards: int) -> None:
    config = tiny_config()
    written = write_random_checkpoint(tmp_path, config, shards=shards, seed=shards)
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shards > 1)
    loaded = load_model(tmp_path)
    model, tokenizer, loaded_config = loaded
    assert loaded_config == config
    state = model.state_dict()
    assert set(state) == set(written)
    for name, tensor in written.items():
        assert torch.equal(state[name], tensor), name
    text = "def f(x):\n\treturn x + 1  # ok"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_tokens_to_ids("<|mask|>") == loaded.mask_token_id == special_token_id("<|mask|>")
    assert loaded.eos_token_ids == (special_token_id("<|endoftext|>"),)


def test_dtype_and_window_model(checkpoint: tuple[Path, dict[str, torch.Tensor]]) -> None:
    directory, written = checkpoint
    loaded = load_model(directory, dtype="bfloat16")
    assert loaded.model.dtype == torch.bfloat16
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(loaded.model.state_dict()[name], written[name].bfloat16())
    window = loaded.window_model(max_length=32, num_slots=2)
    assert isinstance(window, WindowedLM)
    assert window.kv.cache.dtype == torch.bfloat16
    assert (window.vocab_size, window.max_length, window.cache_length()) == (128, 32, 0)
    with pytest.raises(ValueError, match=r"dtype"):
        load_model(directory, dtype="float8")


def test_special_ids_fall_back_to_tokenizer(tmp_path: Path) -> None:
    write_random_checkpoint(tmp_path, tiny_config(mask_token_id=None, eos_token_ids=(), pad_token_id=None))
    loaded = load_model(tmp_path)
    assert loaded.mask_token_id == special_token_id("<|mask|>")
    assert loaded.eos_token_ids == (special_token_id("<|endoftext|>"),)
    assert loaded.special.pad == special_token_id("<|endoftext|>")


def test_generation_config_adds_eos_ids(tmp_path: Path) -> None:
    write_random_checkpoint(tmp_path, tiny_config())
    eos, im_end = special_token_id("<|endoftext|>"), special_token_id("<|im_end|>")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, im_end]}))
    assert load_model(tmp_path).eos_token_ids == (eos, im_end)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "end"}))
    with pytest.raises(CheckpointError, match=r"generation_config\.json: eos_token_id"):
        load_model(tmp_path)


def test_rotary_buffers_in_the_file_are_ignored(tmp_path: Path) -> None:
    write_random_checkpoint(tmp_path, tiny_config())
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, path)
    assert load_model(tmp_path).model is not None


def test_tied_embeddings_without_lm_head(tmp_path: Path) -> None:
    written = write_random_checkpoint(tmp_path, tiny_config(tie_word_embeddings=True))
    assert "lm_head.weight" not in written
    model = load_model(tmp_path).model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


# ---- each missing or inconsistent piece is named -------------------------------------------------


def test_missing_config(tmp_path: Path) -> None:
    write_random_checkpoint(tmp_path, tiny_config())
    (tmp_path / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config.json: file not found"):
        load_model(tmp_path)


def test_bad_config_field(tmp_path: Path) -> None:
    write_random_checkpoint(tmp_path, tiny_config())
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["num_attention_heads"] = 3
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"config.json: hidden_size \(64\) is not divisible"):
        load_model(tmp_path)


def test_missing_weights_file(tmp_path: Path) -> None:
    write_random_checkpoint(tmp_path, tiny_config())
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model.safetensors: file not found"):
        load_model(tmp_path)


def test_missing_shard(tmp_path: Path) -> None:
    write_random_checkpoint(tmp_path, tiny_config(), shards=3)
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003.safetensors: shard listed in"):
        load_model(tmp_path)


def test_missing_tensor(tmp_path: Path) -> None:
    write_random_checkpoint(tmp_path, tiny_config())
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.v_proj.bias"]
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=r"missing tensor model.layers.1.self_attn.v_proj.bias"):
        load_model(tmp_path)


def test_tensor_missing_from_its_shard(tmp_path: Path) -> None:
    write_random_checkpoint(tmp_path, tiny_config(), shards=2)
    shard = tmp_path / "model-00001-of-00002.safetensors"
    tensors = load_file(shard)
    del tensors["model.embed_tokens.weight"]
    save_file(tensors, shard)
    with pytest.raises(
        CheckpointError, match=r"00001-of-00002.safetensors: missing tensor model.embed_tokens"
    ):
        load_model(tmp_path)


def test_wrong_shape(tmp_path: Path) -> None:
    write_random_checkpoint(tmp_path, tiny_config())
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.up_proj.weight has shape \(64, 64\)"):
        load_model(tmp_path)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_naming_the_file(tmp_path: Path, bad: float) -> None:
    """A NaN or inf weight fails the load naming the tensor and the file, not a ready server."""
    write_random_checkpoint(tmp_path, tiny_config())
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.1.self_attn.o_proj.weight"][3, 5] = bad
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=r"o_proj\.weight has non-finite values") as error:
        load_model(tmp_path)
    assert str(path) in str(error.value)


def test_non_finite_adapter_weights_are_refused(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    write_random_lora_adapter(tmp_path, tiny_config())
    path = tmp_path / "adapter_model.safetensors"
    tensors = load_file(path)
    name = next(iter(tensors))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=re.escape(f"{name} has non-finite values")):
        load_model(checkpoint[0], adapter_dir=tmp_path)


def test_unexpected_tensor(tmp_path: Path) -> None:
    write_random_checkpoint(tmp_path, tiny_config())
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.2.mlp.up_proj.weight"] = torch.zeros(128, 64)
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=r"unexpected tensor model.layers.2.mlp.up_proj.weight"):
        load_model(tmp_path)


def test_missing_tokenizer(tmp_path: Path) -> None:
    write_random_checkpoint(tmp_path, tiny_config())
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / name).unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer.json"):
        load_model(tmp_path)


def test_missing_adapter_files(checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    directory, _ = checkpoint
    with pytest.raises(CheckpointError, match=r"adapter_config.json: file not found"):
        load_model(directory, adapter_dir=tmp_path)
    write_random_lora_adapter(tmp_path, tiny_config())
    (tmp_path / "adapter_model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"adapter_model.safetensors: file not found"):
        load_model(directory, adapter_dir=tmp_path)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"peft_type": "IA3"}, "peft_type"),
        ({"r": 0}, "r must be"),
        ({"lora_alpha": None}, "lora_alpha"),
        ({"use_dora": True}, "use_dora"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"bias": "all"}, "bias"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"target_modules": []}, "target_modules"),
        ({"target_modules": ["q_proj"]}, "target_modules"),  # the file also holds k/v/o weights
        ({"r": 8}, "rank r=8"),
    ],
)
def test_bad_adapter_config(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, change: dict, field: str
) -> None:
    directory, _ = checkpoint
    write_random_lora_adapter(tmp_path, tiny_config(), r=4)
    config_path = tmp_path / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **change}))
    with pytest.raises(CheckpointError, match=field):
        load_model(directory, adapter_dir=tmp_path)


def test_adapter_for_another_model(checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    directory, _ = checkpoint
    write_random_lora_adapter(tmp_path, tiny_config(hidden_size=32, intermediate_size=64))
    with pytest.raises(
        CheckpointError, match=r"adapter_model.safetensors: model.layers.0.self_attn.\w_proj: lora_B @ lora_A"
    ):
        load_model(directory, adapter_dir=tmp_path)


def test_loading_skips_the_random_init_whose_imports_cost_a_second() -> None:
    # Every worker and master loads a checkpoint at start: Embedding's default init on the meta
    # device imports torch._dynamo (~0.9 s) for a weight the files replace.
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from lopa.engine import bundled_model_dir\n"
        "from lopa.model import load_model\n"
        "load_model(bundled_model_dir())\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
