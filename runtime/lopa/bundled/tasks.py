"""The bundled task suite: short synthetic problems whose answers have to be filled in an order.

Each example is `prompt` (ends with '=') followed by `answer` and then the EOS token. Three tasks,
all fixed-width so that every answer character sits at a constant distance from the prompt
characters it depends on (RoPE makes that cheap to learn), yet each answer has a dependency chain:

- `add`: 10-digit + 10-digit (zero-padded), the 11-digit sum written most significant digit first.
  A digit depends on the carry from every lower digit: the chain runs right to left.
- `cum`: the running sums mod 10 of 16 digits. Output i is output i-1 plus input i: the chain runs
  left to right, one hop per character.
- `dep`: the nesting depth after each character of a balanced 16-character bracket string (bracket
  matching): depth i is depth i-1 +/- 1, again a left-to-right chain.

The split is a property of the prompt (a CRC32 bucket), so train and held-out are disjoint by
construction and any seed gives the same held-out set membership.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

TASKS = ("add", "cum", "dep")
ADD_DIGITS = 10
CUM_DIGITS = 16
DEP_LENGTH = 16
MAX_DEPTH = 8
HELD_OUT_BUCKETS = 10  # 1 prompt in 10 belongs to the held-out split
HELD_OUT_SEED = 20251122  # the published held-out set: first N held-out examples from this seed
PROMPT_MAX = 26  # longest prompt ("add:" + 10 + "+" + 10 + "=")
ANSWER_MAX = 16  # longest answer, EOS excluded


@dataclass(frozen=True)
class Example:
    task: str
    prompt: str
    answer: str  # without the EOS token


def make_add(rng: random.Random) -> Example:
    a, b = rng.randrange(10**ADD_DIGITS), rng.randrange(10**ADD_DIGITS)
    # Bias toward long carry chains: half the time make b's digits complement a's (sum digit 9).
    if rng.random() < 0.5:
        width = rng.randint(2, ADD_DIGITS)
        low = rng.randint(0, ADD_DIGITS - width)
        digits = list(f"{b:0{ADD_DIGITS}d}")
        for i in range(low, low + width):
            digits[i] = str(9 - int(f"{a:0{ADD_DIGITS}d}"[i]))
        b = int("".join(digits))
    prompt = f"add:{a:0{ADD_DIGITS}d}+{b:0{ADD_DIGITS}d}="
    return Example("add", prompt, f"{a + b:0{ADD_DIGITS + 1}d}")


def make_cum(rng: random.Random) -> Example:
    digits = [rng.randrange(10) for _ in range(CUM_DIGITS)]
    total, sums = 0, []
    for d in digits:
        total = (total + d) % 10
        sums.append(str(total))
    return Example("cum", "cum:" + "".join(map(str, digits)) + "=", "".join(sums))


def make_dep(rng: random.Random) -> Example:
    """A uniformly-ish random balanced bracket string (depth <= MAX_DEPTH) and its depth profile."""
    chars, depths, depth = [], [], 0
    for i in range(DEP_LENGTH):
        remaining = DEP_LENGTH - i
        if depth == 0:
            opening = True
        elif depth >= remaining or depth >= MAX_DEPTH:
            opening = False  # must close to end balanced (or stay within the depth limit)
        else:
            opening = rng.random() < 0.5
        depth += 1 if opening else -1
        chars.append("(" if opening else ")")
        depths.append(str(depth))
    return Example("dep", "dep:" + "".join(chars) + "=", "".join(depths))


MAKERS: dict[str, Callable[[random.Random], Example]] = {"add": make_add, "cum": make_cum, "dep": make_dep}


def solve(task: str, prompt: str) -> str:
    """The reference answer of any prompt (used by scoring and tests)."""
    body = prompt.removeprefix(f"{task}:").removesuffix("=")
    if task == "add":
        a, b = body.split("+")
        return f"{int(a) + int(b):0{ADD_DIGITS + 1}d}"
    if task == "cum":
        total, out = 0, []
        for ch in body:
            total = (total + int(ch)) % 10
            out.append(str(total))
        return "".join(out)
    if task == "dep":
        depth, out = 0, []
        for ch in body:
            depth += 1 if ch == "(" else -1
            out.append(str(depth))
        return "".join(out)
    raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")


def is_held_out(prompt: str) -> bool:
    return zlib.crc32(prompt.encode()) % HELD_OUT_BUCKETS == 0


def examples(split: str, seed: int, tasks: Sequence[str] = TASKS) -> Iterator[Example]:
    """An endless deterministic stream of one split ('train' or 'held_out'), tasks round-robin."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    want_held_out = split == "held_out"
    rng = random.Random(seed)
    while True:
        for task in tasks:
            while True:
                example = MAKERS[task](rng)
                if is_held_out(example.prompt) == want_held_out:
                    break
            yield example


def held_out(n: int, tasks: Sequence[str] = TASKS) -> list[Example]:
    """The published held-out set: its first n examples (the same on every machine)."""
    stream = examples("held_out", HELD_OUT_SEED, tasks)
    return [next(stream) for _ in range(n)]


def score(example: Example, output: str) -> bool:
    """Exact match: the decoded text up to the EOS (special tokens stripped) equals the answer."""
    return output.strip() == example.answer
