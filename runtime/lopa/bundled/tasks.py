"""The bundled task suite: hide the end of each word, where the filling order sets the speed.

Each example is `prompt` (ends with '=') followed by an answer and then the EOS token. The input
is 3 groups of 7 letters separated by dots (`head:abcdeFG.xyzwvuT.pqrstuv=`); the answer writes
every group in place, each after a dot, then a final dot (`.abcdeFG.xyzwvuT.pqrstuv.`). A group
has a lowercase run of 5 to 7 letters and uppercase letters around it, and the writer may hide
any number c of the run's letters, from its outer end, writing each hidden letter as the digit c:

- `head`: the run starts the group (`abcdeFG`); the first c letters are hidden: `abcdeFG`,
  `1bcdeFG`, `22cdeFG`, ... `55555FG`.
- `tail`: the run ends the group (`Abcdefg`); the last c letters are hidden: `Abcdefg`,
  `Abcdef1`, `Abcde22`, ... `A666666`.

Uppercase letters are always copied. Every c from 0 to the run's length is valid; the writer picks
c = 0 (nothing hidden) twice as often as each other count (`KEEP_WEIGHT`). An output is correct when
every group is one of its valid forms and the dots are in place (`is_valid`); `Example.answer` is
the canonical answer (nothing hidden).

Why this structure: the order in which a group's positions are committed decides how much of it
the next round can fill, and the model's own confidence points at the wrong end.
- Before anything of a run is committed, the letter nearest its inner end (next to the uppercase
  letters) is the most confident position: it is hidden only when the whole run is (c = the run's
  length). Each position further out is hidden more often, and the outermost letter is kept only
  when nothing is hidden, so it is the least confident (its alternatives, one digit per count,
  spread the probability).
- Committing a position's most likely token, its letter, says only that fewer letters are hidden
  than its distance from the outer end: every position on its inner side becomes certain, the
  outer ones stay open. Committing the most confident position unlocks nothing; the k-th most
  confident unlocks k - 1 others; the outermost letter, the least confident, settles the whole
  group at once.
- So D2F, whose fallback fills the most confident position, fills a run one letter per round,
  and LoPA with k lookahead branches reaches k positions deep: each extra branch finds a better
  order. A run of up to 7 letters keeps the gain rising up to k = 7.
- The counts bound the confidences below tau_conf 0.9: the most confident open position of a run
  of n letters has probability (n + 1) / (n + 2) <= 8/9, before and after any commit, so no letter
  is filled by threshold before the order has chosen it.
- Keeping (c = 0) weighs twice any other count so that a letter stays each position's most likely
  token: committed tokens never contradict each other, whichever order fills them.
- Every 8-token block starts with a dot: the first position of a decoding window is predicted
  from the stored last logit and cannot see a partner committed later, and dots make group
  membership visible.
- 3 words, not more: a round's lookahead branches go to the most confident positions of every
  open word, and a fresh word's most confident positions unlock nothing. Decoded with the suite's
  exact posteriors (lopa.synthetic.posterior), 6 words gain 14% from k = 1 to k = 3 where 3 words
  gain 35%; runs of 4 to 6 letters stop gaining at k = 6 (runtime/BENCHMARKS.md, "Why the
  suite is shaped as it is").

The split is a property of the prompt (a CRC32 bucket), so train and held-out are disjoint by
construction and any seed gives the same held-out set membership.
"""

from __future__ import annotations

import random
import string
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

TASKS = ("head", "tail")
GROUPS = 3
GROUP_SIZE = 7
RUN_LENGTHS = (5, 6, 7)  # lowercase letters per group: the part that may be hidden
SEPARATOR = "."
KEEP_WEIGHT = 2  # the writer's weight of hiding nothing; every other count weighs 1
HELD_OUT_BUCKETS = 10  # 1 prompt in 10 belongs to the held-out split
HELD_OUT_SEED = 20251122  # the published held-out set: first N held-out examples from this seed
PROMPT_MAX = 5 + GROUPS * (GROUP_SIZE + 1)  # "head:" + the groups and their dots + "="
ANSWER_MAX = GROUPS * (GROUP_SIZE + 1) + 1  # a dot and a group per group, the final dot; EOS excluded


@dataclass(frozen=True)
class Example:
    task: str
    prompt: str
    answer: str  # the canonical answer (nothing hidden), without the EOS token


def _check(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")


def run_length(task: str, group: str) -> int:
    """The lowercase run's length: the letters that may be hidden."""
    _check(task)
    letters = group if task == "head" else group[::-1]
    return len(letters) - len(letters.lstrip(string.ascii_lowercase))


def forms(task: str, group: str) -> tuple[str, ...]:
    """Every valid way of writing one group, by the number of hidden letters (0 first)."""
    n = run_length(task, group)
    if task == "head":
        return tuple(str(c) * c + group[c:] for c in range(n + 1))
    return tuple(group[: len(group) - c] + str(c) * c for c in range(n + 1))


def make_group(task: str, rng: random.Random) -> str:
    n = rng.choice(RUN_LENGTHS)
    letters = [rng.choice(string.ascii_lowercase) for _ in range(GROUP_SIZE)]
    if task == "head":
        return "".join(letters[:n]) + "".join(letters[n:]).upper()
    return "".join(letters[: GROUP_SIZE - n]).upper() + "".join(letters[GROUP_SIZE - n :])


def make_example(task: str, rng: random.Random) -> tuple[Example, str]:
    """One prompt with its canonical answer, and a training answer with a drawn count per group."""
    _check(task)
    given = [make_group(task, rng) for _ in range(GROUPS)]
    written = []
    for group in given:
        options = forms(task, group)
        written.append(rng.choices(options, [KEEP_WEIGHT] + [1] * (len(options) - 1))[0])
    example = Example(task, f"{task}:{SEPARATOR.join(given)}=", _answer(given))
    return example, _answer(written)


def _answer(groups: Sequence[str]) -> str:
    return "".join(SEPARATOR + g for g in groups) + SEPARATOR


def _body(task: str, prompt: str) -> list[str]:
    _check(task)
    return prompt.removeprefix(f"{task}:").removesuffix("=").split(SEPARATOR)


def solve(task: str, prompt: str) -> str:
    """The canonical answer of any prompt (nothing hidden)."""
    return _answer(_body(task, prompt))


def is_valid(task: str, prompt: str, output: str) -> bool:
    """Whether `output` writes every group of the prompt in one of its valid forms."""
    given, written = _body(task, prompt), output.split(SEPARATOR)
    if written[0] != "" or written[-1] != "" or len(written) != len(given) + 2:
        return False  # not '.' + one part per group + a final '.'
    return all(w in forms(task, g) for g, w in zip(given, written[1:-1], strict=True))


def is_held_out(prompt: str) -> bool:
    return zlib.crc32(prompt.encode()) % HELD_OUT_BUCKETS == 0


def training_pairs(split: str, seed: int, tasks: Sequence[str] = TASKS) -> Iterator[tuple[Example, str]]:
    """An endless deterministic stream of (example, written answer), tasks round-robin."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    want_held_out = split == "held_out"
    rng = random.Random(seed)
    while True:
        for task in tasks:
            while True:
                example, written = make_example(task, rng)
                if is_held_out(example.prompt) == want_held_out:
                    break
            yield example, written


def examples(split: str, seed: int, tasks: Sequence[str] = TASKS) -> Iterator[Example]:
    """An endless deterministic stream of one split ('train' or 'held_out')."""
    return (example for example, _ in training_pairs(split, seed, tasks))


def held_out(n: int, tasks: Sequence[str] = TASKS) -> list[Example]:
    """The published held-out set: its first n examples (the same on every machine)."""
    stream = examples("held_out", HELD_OUT_SEED, tasks)
    return [next(stream) for _ in range(n)]


def score(example: Example, output: str) -> bool:
    """Exact match against the valid answers: the decoded text up to the EOS (special tokens
    stripped, surrounding whitespace ignored) writes every group in one of its valid forms."""
    return is_valid(example.task, example.prompt, output.strip())
