"""ModelConfig: reading Dream's config.json and rejecting inconsistent fields by name."""

import json
from pathlib import Path

import pytest

from lopa.model import CheckpointError, ModelConfig
from lopa.synthetic import tiny_config

DREAM_7B = {
    "architectures": ["DreamModel"],
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "mask_token_id": 151666,
    "max_position_embeddings": 131072,
    "model_type": "Dream",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "pad_token_id": 151643,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 152064,
}


def test_reads_dream_7b_config() -> None:
    config = ModelConfig.from_dict(DREAM_7B)
    assert config.head_dim == 128
    assert config.num_key_value_heads == 4
    assert config.mask_token_id == 151666
    assert config.eos_token_ids == (151643,)
    assert config.rope_theta == 1e6


def test_eos_list_and_json_round_trip(tmp_path: Path) -> None:
    config = tiny_config(eos_token_ids=(97, 99))
    path = tmp_path / "config.json"
    config.to_json(path)
    assert json.loads(path.read_text())["eos_token_id"] == [97, 99]
    assert ModelConfig.from_file(path) == config
    single = tiny_config()
    assert ModelConfig.from_dict(json.loads(single.to_json())) == single


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"hidden_size": 3583}, "hidden_size"),
        ({"num_key_value_heads": 5}, "num_key_value_heads"),
        ({"vocab_size": "many"}, "vocab_size"),
        ({"mask_token_id": 200000}, "mask_token_id"),
        ({"eos_token_id": [151643, -1]}, "eos_token_id"),
        ({"rms_norm_eps": 0}, "rms_norm_eps"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ],
)
def test_bad_field_is_named(tmp_path: Path, overrides: dict, field: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**DREAM_7B, **overrides}))
    with pytest.raises(CheckpointError, match=field) as info:
        ModelConfig.from_file(path)
    assert info.value.path == str(path)


def test_missing_field_is_named(tmp_path: Path) -> None:
    raw = dict(DREAM_7B)
    del raw["intermediate_size"]
    with pytest.raises(CheckpointError, match=r"intermediate_size"):
        ModelConfig.from_dict(raw, tmp_path / "config.json")


def test_missing_or_broken_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"config.json: file not found"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"not valid JSON"):
        ModelConfig.from_dir(tmp_path)
