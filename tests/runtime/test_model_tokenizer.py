"""Tokenizer loading without remote code, including Dream's layout (vocab.json + merges.txt + auto_map)."""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tokenizers import pre_tokenizers

from lopa.model import CheckpointError, load_tokenizer
from lopa.model.tokenizer import chat_ids
from lopa.params import InvalidParameter
from lopa.synthetic import write_char_tokenizer


def _special(content: str) -> dict:
    return {"content": content, "special": True, "lstrip": False, "rstrip": False, "normalized": False}


def _write_dream_style_tokenizer(directory: Path) -> dict[str, int]:
    """A tiny byte-level BPE whose tokenizer_config points AutoTokenizer at remote code, like Dream's."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update(he=len(vocab), ll=len(vocab) + 1)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\nh e\nl l\n")
    eos, mask = len(vocab), len(vocab) + 1
    config = {
        "tokenizer_class": "DreamTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]},
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "added_tokens_decoder": {str(eos): _special("<|endoftext|>"), str(mask): _special("<|mask|>")},
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return {"he": vocab["he"], "eos": eos, "mask": mask}


def test_dream_layout_loads_without_remote_code(tmp_path: Path) -> None:
    ids = _write_dream_style_tokenizer(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer("he<|mask|>")["input_ids"] == [ids["he"], ids["mask"]]
    assert tokenizer.eos_token_id == ids["eos"]
    assert tokenizer.decode(tokenizer("hello world")["input_ids"]) == "hello world"


def test_char_tokenizer_round_trip(tmp_path: Path) -> None:
    write_char_tokenizer(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    text = "x = [1, 2]\n<|endoftext|>"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_unloadable_tokenizer_is_named(tmp_path: Path) -> None:
    write_char_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": ')  # cut short
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: cannot load the tokenizer") as error:
        load_tokenizer(tmp_path)
    assert "\n" not in str(error.value)


def test_a_broken_tokenizer_json_is_named(tmp_path: Path) -> None:
    """The error names tokenizer.json, the file at fault, not tokenizer_config.json."""
    write_char_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "NoSuchModel"')
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: not a valid tokenizer file: "):
        load_tokenizer(tmp_path)


def test_missing_tokenizer_files_are_one_clear_line(tmp_path: Path) -> None:
    """One line naming the missing file, not transformers' 5-line 'install sentencepiece' advice."""
    write_char_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError) as error:
        load_tokenizer(tmp_path)
    assert str(error.value) == f"{tmp_path / 'tokenizer.json'}: file not found (nor vocab.json + merges.txt)"


def test_a_chat_template_that_refuses_the_messages_is_named(tmp_path: Path) -> None:
    """A template's raise_exception (e.g. roles that must alternate) is the caller's bad input, not
    a server error: InvalidParameter("chat") with the template's words (the HTTP API: "messages")."""
    write_char_tokenizer(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'developer' %}"
        "{{ raise_exception('developer messages are not supported') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    assert tokenizer.decode(chat_ids(tokenizer, [{"role": "user", "content": "hi"}])) == "hi"
    with pytest.raises(InvalidParameter, match="developer messages are not supported") as caught:
        chat_ids(tokenizer, [{"role": "developer", "content": "hi"}])
    assert caught.value.field == "chat"


def _auto_tokenizer(directory: Path) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(
        str(directory), local_files_only=True, trust_remote_code=False)


@pytest.mark.parametrize("declared", ["PreTrainedTokenizerFast", "PreTrainedTokenizer", "TokenizersBackend",
                                      "Qwen2TokenizerFast", "Qwen2Tokenizer", "NoSuchTokenizer"])
def test_a_dream_checkpoints_tokenizer_is_the_one_autotokenizer_gives(tmp_path: Path, declared: str) -> None:
    """For model_type Dream load_tokenizer takes the class tokenizer_config.json names without
    AutoTokenizer (whose config machinery imports torch); it is the tokenizer AutoTokenizer gives."""
    write_char_tokenizer(tmp_path, chat_template="{{ messages[0]['content'] }}")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "Dream"}))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": declared}))
    ours, auto = load_tokenizer(tmp_path), _auto_tokenizer(tmp_path)
    assert type(ours) is type(auto)
    text = "x = [1, 2]\n<|mask|><|endoftext|>"
    assert ours(text)["input_ids"] == auto(text)["input_ids"]
    assert ours.decode(auto(text)["input_ids"]) == auto.decode(auto(text)["input_ids"])
    assert (ours.eos_token_id, ours.pad_token_id, ours.mask_token_id) == (
        auto.eos_token_id, auto.pad_token_id, auto.mask_token_id)
    turn = [{"role": "user", "content": "hi"}]
    assert chat_ids(ours, turn) == chat_ids(auto, turn)


def test_the_bundled_tokenizer_loads_without_torch() -> None:
    """What a master pays to start: its tokenizer, and no torch."""
    script = ("import sys\nfrom lopa.bundled import bundled_model_dir\n"
              "from lopa.model import load_tokenizer\n"
              "tokenizer = load_tokenizer(bundled_model_dir())\n"
              "print(type(tokenizer).__name__, [m for m in sys.modules if m.split('.')[0] == 'torch'][:3])\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["TokenizersBackend", "[]"], done.stdout + done.stderr


def test_a_dream_layout_with_its_config_loads_the_qwen2_tokenizer_directly(tmp_path: Path) -> None:
    ids = _write_dream_style_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "Dream"}))
    tokenizer = load_tokenizer(tmp_path)
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    assert tokenizer("he<|mask|>")["input_ids"] == [ids["he"], ids["mask"]]
