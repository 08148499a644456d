"""The bundled model decodes its held-out split, and LoPA beats D2F on it (BENCHMARKS.md targets)."""

from __future__ import annotations

import pytest

from lopa.bench.evaluate import evaluate
from lopa.bundled import tasks
from lopa.bundled.defaults import model_defaults
from lopa.engine import LocalEngine, bundled_model_dir
from lopa.model import load_model

PROMPTS = 20


def test_bundled_checkpoint_is_small_and_in_the_real_format() -> None:
    directory = bundled_model_dir()
    size = sum(f.stat().st_size for f in directory.iterdir() if f.is_file())
    assert size <= 20 * 1024 * 1024
    for name in ("config.json", "model.safetensors", "tokenizer.json", "MODEL_CARD.md", "lopa_defaults.json"):
        assert (directory / name).is_file(), name
    loaded = load_model(directory)
    assert loaded.tokenizer.convert_tokens_to_ids("<|mask|>") == loaded.special.mask
    assert loaded.tokenizer.convert_tokens_to_ids("<|endoftext|>") in loaded.special.eos


@pytest.mark.parametrize("attention", ["block_causal", "full"])
def test_lopa_k4_beats_d2f_tpf_at_equal_accuracy(bundled_engine: LocalEngine, attention: str) -> None:
    examples = tasks.held_out(PROMPTS)
    base = model_defaults(bundled_model_dir()).with_overrides(attention=attention)
    d2f = evaluate(bundled_engine, examples, base.with_overrides(branches=0))
    lopa = evaluate(bundled_engine, examples, base.with_overrides(branches=4))
    assert lopa.tpf > d2f.tpf, (lopa.tpf, d2f.tpf)
    # The suite is built so that a lookahead token completes a whole group (x2.5 on 300 prompts):
    # a model that gains only "one token more per round" (chain-like tasks give x1.3) fails here.
    assert lopa.tpf >= 1.8 * d2f.tpf, (lopa.tpf, d2f.tpf)
    assert 100 * lopa.exact_match >= 100 * d2f.exact_match - 1.0, (lopa.exact_match, d2f.exact_match)
    assert d2f.exact_match >= 0.9  # the model genuinely solves the tasks


def test_generate_cli_answers_a_held_out_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    from lopa.cli import main

    example = tasks.held_out(1)[0]
    defaults = model_defaults(bundled_model_dir())
    flags = ["--block-size", str(defaults.block_size), "--max-new-tokens", str(defaults.max_new_tokens)]
    assert main(["generate", "--prompt", example.prompt, "--branches", "4", *flags]) == 0
    assert tasks.score(example, capsys.readouterr().out)
