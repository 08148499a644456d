"""The bundled task suite: reference answers, disjoint deterministic splits, exact-match scoring."""

from __future__ import annotations

import itertools

import pytest

from lopa.bundled import tasks
from lopa.testing import write_char_tokenizer
from lopa.training.data import EOS, char_ids, encode


def test_reference_answers_of_hand_cases() -> None:
    assert tasks.solve("add", "add:0000000999+0000000001=") == "00000001000"
    assert tasks.solve("add", "add:9999999999+9999999999=") == "19999999998"
    assert tasks.solve("cum", "cum:1234567890123456=") == "1360518655681506"
    assert tasks.solve("dep", "dep:(()())((()))()()=") == "1212101232101010"
    with pytest.raises(ValueError, match="unknown task"):
        tasks.solve("mul", "mul:1*2=")


@pytest.mark.parametrize("split", ["train", "held_out"])
def test_generated_examples_are_solved_and_fit_the_length_budget(split: str) -> None:
    for example in itertools.islice(tasks.examples(split, seed=3), 300):
        assert tasks.solve(example.task, example.prompt) == example.answer
        assert len(example.prompt) <= tasks.PROMPT_MAX and len(example.answer) <= tasks.ANSWER_MAX
        assert len(example.prompt) + len(example.answer) + 1 <= 64  # + EOS


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


def test_dep_strings_are_balanced_and_shallow() -> None:
    for example in itertools.islice(tasks.examples("train", seed=5, tasks=("dep",)), 500):
        depths = [int(d) for d in example.answer]
        assert depths[-1] == 0 and min(depths) >= 0 and max(depths) <= tasks.MAX_DEPTH


def test_exact_match_scoring() -> None:
    example = tasks.Example("cum", "cum:1111111111111111=", "1234567890123456")
    assert tasks.score(example, "1234567890123456")
    assert tasks.score(example, "1234567890123456\n")  # surrounding whitespace is not an error
    assert not tasks.score(example, "1234567890123457")
    assert not tasks.score(example, "123456789012345")
    assert not tasks.score(example, "1234567890123456 0")


def test_training_ids_match_the_saved_tokenizer(tmp_path) -> None:
    from transformers import AutoTokenizer

    write_char_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    example = tasks.held_out(3)[2]
    assert char_ids(example.prompt) == tokenizer.encode(example.prompt, add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") == EOS
    ids, blocks = encode(example, block_size=8, gen_blocks=4)
    assert len(ids) == len(example.prompt) + 32 and ids[-1] == EOS
    assert blocks[len(example.prompt)] == 1 and blocks[-1] == 4
