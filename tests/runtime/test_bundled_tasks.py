"""The bundled task suite: valid forms, disjoint deterministic splits, exact-match scoring, and the
structure that makes the filling order matter (checked on the training data's own posteriors)."""

from __future__ import annotations

import collections
import itertools

import pytest

from lopa.bundled import tasks
from lopa.synthetic import write_char_tokenizer
from lopa.training import TrainConfig
from lopa.training.data import EOS, char_ids, encode


def test_forms_and_canonical_answers_of_hand_cases() -> None:
    hidden = ("abcdeFG", "1bcdeFG", "22cdeFG", "333deFG", "4444eFG", "55555FG")
    assert tasks.forms("head", "abcdeFG") == hidden
    assert tasks.forms("tail", "Abcdefg")[:3] == ("Abcdefg", "Abcdef1", "Abcde22")
    assert tasks.forms("tail", "Abcdefg")[-1] == "A666666"
    assert tasks.solve("tail", "tail:Abcdefg.QRstuvw.xyzabcd=") == ".Abcdefg.QRstuvw.xyzabcd."
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
        for group in example.answer.split(tasks.SEPARATOR)[1:-1]:
            assert tasks.run_length(example.task, group) in tasks.RUN_LENGTHS


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


def test_the_writer_keeps_every_letter_twice_as_often_as_it_hides_any_count() -> None:
    counts: collections.Counter[int] = collections.Counter()
    for example, written in itertools.islice(tasks.training_pairs("train", 0, ("head",)), 3000):
        assert tasks.is_valid("head", example.prompt, written)
        for given, out in zip(example.answer.split(".")[1:-1], written.split(".")[1:-1], strict=True):
            if tasks.run_length("head", given) == 7:
                counts[tasks.forms("head", given).index(out)] += 1
    kept, hidden = counts[0], [counts[c] for c in range(1, 8)]
    assert all(1.6 < kept / n < 2.5 for n in hidden), counts


CERTAIN = 1 - 1e-9  # a probability summed from fractions


def posterior(task: str, group: str, shown: dict[int, str]) -> list[dict[str, float]]:
    """Each position's distribution given the characters shown, under the writer's weights."""
    forms = tasks.forms(task, group)
    weights = [tasks.KEEP_WEIGHT if c == 0 else 1 for c in range(len(forms))]
    agree = [(f, w) for f, w in zip(forms, weights, strict=True)
             if all(f[i] == ch for i, ch in shown.items())]
    total = sum(w for _, w in agree)
    out: list[dict[str, float]] = [collections.defaultdict(float) for _ in group]
    for form, weight in agree:
        for i, ch in enumerate(form):
            out[i][ch] += weight / total
    return out


@pytest.mark.parametrize(("task", "group"), [("head", "abcdefg"), ("tail", "ABcdefg"), ("head", "abcdeFG")])
def test_the_most_confident_position_unlocks_least(task: str, group: str) -> None:
    """Before any commit: every position's most likely token is its letter, below tau_conf 0.9;
    committing the r-th most confident position makes exactly the r - 1 above it certain."""
    n = tasks.run_length(task, group)
    dists = posterior(task, group, {})
    run = [i for i, d in enumerate(dists) if max(d.values()) < CERTAIN]
    assert len(run) == n
    ranked = sorted(run, key=lambda i: -max(dists[i].values()))
    for i in run:
        best = max(dists[i], key=dists[i].get)
        assert best == group[i] and dists[i][best] <= 8 / 9 + 1e-12 < 0.9
    for rank, position in enumerate(ranked):
        after = posterior(task, group, {position: group[position]})
        certain = [i for i in run if i != position and max(after[i].values()) >= CERTAIN]
        assert sorted(certain) == sorted(ranked[:rank])


def test_exact_match_against_the_valid_answers() -> None:
    example = tasks.Example("head", "head:abcdeFG.xyzwvuT.pqrstuv=", ".abcdeFG.xyzwvuT.pqrstuv.")
    assert tasks.score(example, ".abcdeFG.xyzwvuT.pqrstuv.")
    assert tasks.score(example, ".22cdeFG.666666T.7777777.")  # any count per group
    assert tasks.score(example, " .55555FG.xyzwvuT.1qrstuv.\n")  # surrounding whitespace is fine
    assert not tasks.score(example, ".2bcdeFG.xyzwvuT.pqrstuv.")  # a count that is not the hidden letters'
    assert not tasks.score(example, ".666666G.xyzwvuT.pqrstuv.")  # an uppercase letter hidden
    assert not tasks.score(example, ".a2cdeFG.xyzwvuT.pqrstuv.")  # hidden from the wrong end
    assert not tasks.score(example, ".abcdeFG.xyzwvuT.")  # a group missing
    assert not tasks.score(example, ".abcdeFG.xyzwvuT.pqrstuv")  # the final dot missing
    assert not tasks.score(example, "abcdeFG.xyzwvuT.pqrstuv.")  # the leading dot missing
    assert not tasks.score(example, ".abcdeFGxyzwvuT.pqrstuv.")  # a dot missing
    assert not tasks.score(example, ".abddeFG.xyzwvuT.pqrstuv.")  # a letter changed
    tail = tasks.Example("tail", "tail:Abcdefg.QRstuvw.xyzabcd=", ".Abcdefg.QRstuvw.xyzabcd.")
    assert tasks.score(tail, ".Abcde22.QR55555.7777777.")
    assert not tasks.score(tail, ".22cdefg.QRstuvw.xyzabcd.")  # tail hides from the end


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
