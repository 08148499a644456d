"""The bundled task suite: reference answers, disjoint deterministic splits, exact-match scoring."""

from __future__ import annotations

import itertools

import pytest

from lopa.bundled import tasks
from lopa.synthetic import write_char_tokenizer
from lopa.training import TrainConfig
from lopa.training.data import EOS, char_ids, encode


def test_forms_and_canonical_answers_of_hand_cases() -> None:
    assert tasks.forms("case", "abc") == ("abc", "ABC")
    assert tasks.forms("code", "105") == ("105", "baf")
    assert tasks.solve("code", "code:123.900.045.999.310.777=") == ".123.900.045.999.310.777.!"
    with pytest.raises(ValueError, match="unknown task"):
        tasks.solve("mul", "mul:1*2=")
    with pytest.raises(ValueError, match="unknown task"):
        tasks.forms("mul", "12")


def test_every_block_of_the_answer_starts_with_a_dot() -> None:
    """The first position of a decoding window sees only the stored last logit (see tasks.py)."""
    for example in tasks.held_out(30):
        answer = example.answer
        assert all(answer[i] == tasks.SEPARATOR for i in range(0, len(answer), 8))


@pytest.mark.parametrize("split", ["train", "held_out"])
def test_generated_examples_are_solved_and_fit_the_length_budget(split: str) -> None:
    for example in itertools.islice(tasks.examples(split, seed=3), 300):
        assert tasks.solve(example.task, example.prompt) == example.answer
        assert tasks.score(example, example.answer)
        assert len(example.prompt) <= tasks.PROMPT_MAX and len(example.answer) <= tasks.ANSWER_MAX
        assert len(example.answer) + 1 <= 8 * TrainConfig().gen_blocks  # + EOS: fits the trained region


def test_splits_are_deterministic_and_disjoint() -> None:
    held = tasks.held_out(200)
    assert held == tasks.held_out(200)  # the same set on every call/machine
    assert {e.task for e in held} == set(tasks.TASKS)
    train = [e.prompt for e in itertools.islice(tasks.examples("train", seed=0), 3000)]
    assert not set(train) & {e.prompt for e in held}
    assert all(tasks.is_held_out(e.prompt) for e in held)
    other_seed = [e.prompt for e in itertools.islice(tasks.examples("train", seed=1), 50)]
    assert other_seed != train[:50]
    with pytest.raises(ValueError, match="split"):
        next(tasks.examples("test", seed=0))


def test_training_answers_pick_each_form_half_the_time() -> None:
    picked_alternative, groups, question_marks = 0, 0, 0
    pairs = list(itertools.islice(tasks.training_pairs("train", 0, ("code",)), 400))
    for example, written in pairs:
        assert tasks.is_valid("code", example.prompt, written)
        for given, out in zip(example.answer.split(".")[1:-1], written.split(".")[1:-1], strict=True):
            groups += 1
            picked_alternative += out != given
        question_marks += written.endswith("?")
    assert 0.45 < picked_alternative / groups < 0.55
    assert 0.4 < question_marks / len(pairs) < 0.6


def test_exact_match_against_the_valid_answers() -> None:
    example = tasks.Example("code", "code:123.456.789.000.999.121=", ".123.456.789.000.999.121.!")
    assert tasks.score(example, ".123.456.789.000.999.121.!")
    assert tasks.score(example, ".bcd.456.hij.aaa.999.121.?")  # any group as letters, either mark
    assert tasks.score(example, " .bcd.efg.hij.aaa.jjj.bcb.!\n")  # surrounding whitespace is fine
    assert not tasks.score(example, ".bc4.456.789.000.999.121.!")  # a group half converted
    assert not tasks.score(example, ".123.456.789.000.999.!")  # a group missing
    assert not tasks.score(example, ".123.456.789.000.999.121.")  # the end mark missing
    assert not tasks.score(example, ".123.456.789.000.999.121")
    assert not tasks.score(example, ".123.456.789.000.999.121.x")  # not an end mark
    assert not tasks.score(example, "123.456.789.000.999.121.!")  # the leading dot missing
    assert not tasks.score(example, ".123456.789.000.999.121.!")  # a dot missing
    case = tasks.Example("case", "case:abc.def.ghi.jkl.mno.pqr=", ".abc.def.ghi.jkl.mno.pqr.!")
    assert tasks.score(case, ".ABC.def.GHI.jkl.mno.PQR.?")
    assert not tasks.score(case, ".Abc.def.ghi.jkl.mno.pqr.!")  # a group in mixed case
    assert not tasks.score(case, ".abd.def.ghi.jkl.mno.pqr.!")  # a letter changed


def test_training_ids_match_the_saved_tokenizer(tmp_path) -> None:
    from transformers import AutoTokenizer

    write_char_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    example = tasks.held_out(3)[2]
    assert char_ids(example.prompt) == tokenizer.encode(example.prompt, add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") == EOS
    ids, blocks = encode(example, block_size=8, gen_blocks=7)
    assert len(ids) == len(example.prompt) + 56 and ids[-1] == EOS
    assert blocks[len(example.prompt)] == 1 and blocks[-1] == 7
