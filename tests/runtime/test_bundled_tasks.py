"""The bundled task suite: reference answers, disjoint deterministic splits, exact-match scoring."""

from __future__ import annotations

import itertools

import pytest

from lopa.bundled import tasks
from lopa.testing import write_char_tokenizer
from lopa.training.data import EOS, char_ids, encode


def test_reference_answers_of_hand_cases() -> None:
    assert tasks.solve("cnt", "cnt:111111111111111=") == "123456789abcdef"
    assert tasks.solve("cnt", "cnt:100000000000001=") == "111111111111112"
    assert tasks.solve("par", "par:1101000000000001=") == "1001111111111110"
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


def test_par_inputs_lean_to_zeros() -> None:
    bits = "".join(e.prompt[4:-1] for e in itertools.islice(tasks.examples("train", 0, ("par",)), 300))
    assert 0.25 < bits.count("1") / len(bits) < 0.35


def test_exact_match_scoring() -> None:
    example = tasks.Example("par", "par:1111111111111111=", "1010101010101010")
    assert tasks.score(example, "1010101010101010")
    assert tasks.score(example, "1010101010101010\n")  # surrounding whitespace is not an error
    assert not tasks.score(example, "1010101010101011")
    assert not tasks.score(example, "101010101010101")
    assert not tasks.score(example, "1010101010101010 0")


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
