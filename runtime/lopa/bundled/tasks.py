"""The bundled task suite: copy tasks with a free choice per group, the structure LoPA exploits.

Each example is `prompt` (ends with '=') followed by an answer and then the EOS token. The input
is 12 groups of 3 characters separated by dots (`abc.def.ghi...`); the answer rewrites every
group in place, each after a dot, then a dot and an end mark (`.abc.DEF.ghi...!`).
For each group the writer picks one of two equally valid forms, and the end mark is `!` or `?`
(at random in the training data):

- `case`: groups of lowercase letters, written lowercase or uppercase (`abc` or `ABC`).
- `code`: groups of digits, written as digits or as the letters a-j (`105` or `baf`).

An output is correct when every group is one of its two forms, the dots are in place and it ends
with an end mark (exact match against the set of valid answers, `is_valid`); `Example.answer` is
the canonical answer (every group as given, `!`).

Why this structure: before anything of a group is committed, each of its positions is a 50/50
mixture of the two forms, so none clears a fill threshold and D2F has to spend a forward on its
one-token fallback, then another to fill the rest of the group. Once any position of a group is
committed, the rest is certain. That is how a dLLM sees text (a phrasing choice, then a
determined continuation) and what LoPA's lookahead branches find: a branch that commits one token
of a group makes the rest confident, wins the verification, and the anchor fill commits the rest
in the same round, while D2F's fallback works on another group.

Layout details, each found by measuring an earlier version (runtime/BENCHMARKS.md):
- Dots make group membership visible. With 4 groups of 4 and no separators (membership only by
  position mod 4) the model learned "same case as my neighbour" across group borders.
- Every 8-token block starts with a dot (leading dot, 4-character period). The first position of
  a decoding window is predicted from the stored last logit, computed when the previous token was
  cached, so it cannot see a partner committed later; with pairs and no leading dot, all of D2F's
  errors (32% of prompts) were in the first pair.
- Groups of 3 and the end mark: LoPA spawns lookahead branches from the logits of the round whose
  anchor fill also made the fallback, so a lookahead can land next to the fallback with a stale,
  inconsistent token. While another uncertain position remains, the branch that commits it scores
  better and wins; the independent end mark is such a position up to the last group.
- Only class-changing forms (lower/upper, digit/letter): a group's form shows in any one of its
  characters. Forms that must be compared with the input (rotations, nines' complements) were not
  learned within the 30-minute budget (rotations 67%, complements 0% exact match after 3500 steps).
- 12 groups, not 6: two rounds of every decode are fixed (the first decodes only the dots, the
  end mark settles last), so short answers cap the ratio; with 6 groups LoPA reached x2.15 TPF.

The suite before these (running counts, running parity, bracket depths: left-to-right chains with
a unique answer) let a committed token unlock only the next link, so LoPA gained about one token
per round over D2F.

The split is a property of the prompt (a CRC32 bucket), so train and held-out are disjoint by
construction and any seed gives the same held-out set membership.
"""

from __future__ import annotations

import random
import string
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

TASKS = ("case", "code")
GROUPS = 12
GROUP_SIZE = 3
SEPARATOR = "."
END_MARKS = ("!", "?")  # the answer's last character: either, the writer's choice
HELD_OUT_BUCKETS = 10  # 1 prompt in 10 belongs to the held-out split
HELD_OUT_SEED = 20251122  # the published held-out set: first N held-out examples from this seed
PROMPT_MAX = 53  # longest prompt ("case:" + 47 + "=")
ANSWER_MAX = 50  # longest answer (12 groups, the end mark), EOS excluded
ALPHABETS = {"case": string.ascii_lowercase, "code": string.digits}
_DIGITS_AS_LETTERS = str.maketrans(string.digits, string.ascii_lowercase[:10])


@dataclass(frozen=True)
class Example:
    task: str
    prompt: str
    answer: str  # the canonical answer (every group as given), without the EOS token


def forms(task: str, group: str) -> tuple[str, str]:
    """The two valid ways of writing one group: (as given, alternative)."""
    if task == "case":
        return group, group.upper()
    if task == "code":
        return group, group.translate(_DIGITS_AS_LETTERS)
    raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")


def make_example(task: str, rng: random.Random) -> tuple[Example, str]:
    """One prompt with its canonical answer, and a training answer with a random form per group."""
    given = ["".join(rng.choice(ALPHABETS[task]) for _ in range(GROUP_SIZE)) for _ in range(GROUPS)]
    written = [forms(task, g)[rng.random() < 0.5] for g in given]
    end_mark = END_MARKS[rng.random() < 0.5]
    example = Example(task, f"{task}:{SEPARATOR.join(given)}=", _answer(given, END_MARKS[0]))
    return example, _answer(written, end_mark)


def _answer(groups: Sequence[str], end_mark: str) -> str:
    return "".join(SEPARATOR + g for g in groups) + SEPARATOR + end_mark


def _body(task: str, prompt: str) -> str:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    return prompt.removeprefix(f"{task}:").removesuffix("=")


def solve(task: str, prompt: str) -> str:
    """The canonical answer of any prompt (every group as given)."""
    return _answer(_body(task, prompt).split(SEPARATOR), END_MARKS[0])


def is_valid(task: str, prompt: str, output: str) -> bool:
    """Whether `output` writes every group of the prompt in one of its two valid forms."""
    given, written = _body(task, prompt).split(SEPARATOR), output.split(SEPARATOR)
    if written[0] != "" or len(written) != len(given) + 2 or written[-1] not in END_MARKS:
        return False  # not '.' + one part per group + '.' + an end mark
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
    stripped, surrounding whitespace ignored) writes every group in one of its two forms."""
    return is_valid(example.task, example.prompt, output.strip())
