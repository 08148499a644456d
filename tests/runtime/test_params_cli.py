"""Bad decoding parameters fail with a message naming the field, from the API and from the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lopa.cli import main
from lopa.engine import LocalEngine
from lopa.params import DecodingParams, InvalidParameter

BAD_PARAMS = [
    ({"tau_conf": 1.5}, "tau_conf"),
    ({"tau_add": -0.1}, "tau_add"),
    ({"tau_act": 2.0}, "tau_act"),
    ({"block_size": 0}, "block_size"),
    ({"branches": -1}, "branches"),
    ({"branches": 10_000}, "branches"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"conf": "loudness"}, "conf"),
    ({"attention": "sideways"}, "attention"),
]


@pytest.mark.parametrize(("overrides", "field"), BAD_PARAMS)
def test_api_rejects_bad_params_naming_the_field(overrides: dict, field: str) -> None:
    with pytest.raises(InvalidParameter) as raised:
        DecodingParams(**overrides)
    assert raised.value.field == field
    assert field in str(raised.value)
    assert str(raised.value) == f"{field}: {raised.value.reason}"  # the reason travels as itself


@pytest.mark.parametrize(("overrides", "field"), BAD_PARAMS)
def test_cli_rejects_bad_params_naming_the_flag(
    overrides: dict, field: str, tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in overrides.items()]
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--model", str(tiny_checkpoint), "--prompt", "hi", *flags])
    assert exited.value.code == 2
    flag = "--" + field.replace("_", "-")
    assert flag in capsys.readouterr().err


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> LocalEngine:
    return LocalEngine.from_dirs(tiny_checkpoint, max_length=64)


def test_prompt_over_the_length_limit(engine: LocalEngine) -> None:
    message = "60 tokens leave no room for one block of 8 in max_length 64"
    with pytest.raises(InvalidParameter, match=message) as raised:
        engine.generate("a" * 60, DecodingParams(block_size=8, max_new_tokens=16))
    assert raised.value.field == "prompt"


def test_empty_prompt_and_budget_below_one_block(engine: LocalEngine) -> None:
    with pytest.raises(InvalidParameter) as empty:
        engine.generate("", DecodingParams())
    assert empty.value.field == "prompt"
    # An answer shorter than a block: one whole block is decoded, its first 8 tokens returned.
    small = engine.generate("hi", DecodingParams(block_size=32, max_new_tokens=8))
    whole = engine.generate("hi", DecodingParams(block_size=32, max_new_tokens=32))
    assert small.result.output_ids == whole.result.output_ids[:8]
    assert len(small.result.output_ids) <= 8


def test_cli_generate_json_on_a_real_checkpoint(tiny_checkpoint: Path) -> None:
    """The installed console script decodes a prompt and reports consistent stats."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lopa",
            "generate",
            "--model",
            str(tiny_checkpoint),
            "--prompt",
            "hello",
            "--block-size",
            "8",
            "--max-new-tokens",
            "16",
            "--branches",
            "2",
            "--json",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = json.loads(out.stdout)
    assert report["generated_positions"] == 16
    assert 1 <= report["tokens"] <= 16
    assert report["forwards"] >= 2
    assert report["tpf"] == pytest.approx(report["tokens"] / report["forwards"], abs=1e-3)
    assert report["padded_tpf"] == pytest.approx(16 / (report["forwards"] + 1), abs=1e-3)


def test_cli_reports_a_missing_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--model", str(tmp_path / "nowhere"), "--prompt", "hi"])
    assert exited.value.code == 1
    assert "config.json" in capsys.readouterr().err


def test_chat_without_a_template_names_chat(engine: LocalEngine, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(InvalidParameter) as raised:
        engine.generate("hi", DecodingParams(block_size=8, max_new_tokens=16), chat=True)
    assert raised.value.field == "chat" and "has no chat template" in str(raised.value)
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--model", str(engine.model_dir), "--prompt", "hi", "--chat"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--chat: the model has no chat template" in err and "Traceback" not in err


def test_chat_with_a_template_encodes_the_rendered_turn(tiny_checkpoint: Path, tmp_path: Path) -> None:
    for item in tiny_checkpoint.iterdir():  # the checkpoint plus a chat template
        (tmp_path / item.name).symlink_to(item)
    config_path = tmp_path / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<bot>"
    tokenizer_config["chat_template"] = template
    config_path.unlink()
    config_path.write_text(json.dumps(tokenizer_config))
    engine = LocalEngine.from_dirs(tmp_path, max_length=64)
    ids = engine.encode("hi", chat=True)
    assert ids == engine.encode("<user>hi<bot>") and all(isinstance(t, int) for t in ids)
