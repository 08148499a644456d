"""The bundled task suite under its own exact posteriors (lopa.synthetic.posterior): what its
structure allows a perfect model, decoded by the real Decoder. TPF rises with the branches up to
the deepest word, every answer is valid, and the trained model is measured against this."""

from __future__ import annotations

import itertools

import pytest

from lopa.bundled import bundled_model_dir, tasks
from lopa.model.decoding_defaults import model_defaults
from lopa.synthetic.posterior import PosteriorExecutor, char_id, decode_exactly

EXAMPLES = tasks.held_out(60)


def tpf(k: int) -> float:
    params = model_defaults(bundled_model_dir()).with_overrides(branches=k)
    tokens = forwards = 0
    for example in EXAMPLES:
        result, text = decode_exactly(example, params)
        assert tasks.score(example, text), (example.prompt, text)
        tokens, forwards = tokens + result.tokens, forwards + result.forwards
    return tokens / forwards


def test_tpf_rises_with_the_branches_up_to_the_deepest_word() -> None:
    curve = [tpf(k) for k in range(9)]
    assert all(a <= b for a, b in itertools.pairwise(curve)), curve
    assert curve[3] > curve[1] > curve[0] and curve[7] > curve[5] > curve[3], curve
    assert curve[7] >= 4 * curve[0] and curve[8] == curve[7]  # 7 letters: k = 7 settles any word


def test_a_words_distribution_follows_what_it_shows() -> None:
    example = tasks.Example("head", "head:abcdefg.abcdeFG.abcdeFG=", ".abcdefg.abcdeFG.abcdeFG.")
    executor = PosteriorExecutor(example, mask_id=100, eos_id=97)
    prompt = [char_id(ch) for ch in example.prompt]
    masked = [char_id(".")] + [100] * 7
    first = executor.distribution(prompt + masked, 1)  # nothing shown: a letter 2/9, each count 1/9
    assert first[char_id("a")] == pytest.approx(2 / 9) and first[char_id("7")] == pytest.approx(1 / 9)
    shown = [*prompt, char_id("."), 100, 100, 100, char_id("d"), 100, 100, 100]  # 'd' kept: c < 4
    assert executor.distribution(shown, 7) == {char_id("g"): 1.0}
    assert executor.distribution(shown, 3)[char_id("c")] == pytest.approx(4 / 5)
    assert executor.distribution(shown, 0) == {char_id("."): 1.0}
    assert executor.distribution(shown, 40) == {97: 1.0}  # past the answer: EOS
