"""The bundled task suite: short synthetic problems whose answers have to be filled in an order.

Each example is `prompt` (ends with '=') followed by `answer` and then the EOS token. Three tasks,
all fixed-width so that every answer character sits at a constant distance from the prompt
characters it depends on (RoPE makes that cheap to learn), yet each answer has a dependency chain
that a small model cannot shortcut, so the order in which positions are filled matters:

- `cnt`: for each position of a 15-bit string, the number of 1s up to there, as one hex digit.
  Output i is output i-1 plus input i: a left-to-right counting chain.
- `par`: the running parity (prefix XOR) of 16 bits (1s drawn with probability 0.3). Output i is
  output i-1 XOR input i: the chain runs left to right, one hop per character.
- `dep`: the nesting depth after each character of a balanced 16-character bracket string (bracket
  matching): depth i is depth i-1 +/- 1, again a left-to-right chain.

Tried first and dropped: 10-digit decimal addition, running sums mod 10 and 12-bit binary
addition. Their outputs are uncorrelated with any single input (a sum mod 10 or an XOR of three
bits), so gradient descent gets no first-order signal, and none of them was learned at all in
1000 steps of the 30-minute CPU budget. Every task kept here has an output correlated with one
neighbour (dep, cnt) or made so by the input distribution (par's 1s are rarer than its 0s).
A right-to-left `cnt` (1s from each position to the end) was learned for the right half of the
answer only: D2F's block pipeline decodes the first block first, and its fallback forces a token
per round there before the chain from the right end has reached it, so every chain here runs in
the direction the blocks are decoded.

The split is a property of the prompt (a CRC32 bucket), so train and held-out are disjoint by
construction and any seed gives the same held-out set membership.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

TASKS = ("dep", "cnt", "par")
CNT_BITS = 15  # counts 0..15 fit one hex digit
PAR_BITS = 16
PAR_ONES = 0.3  # probability of a 1 in par inputs
DEP_LENGTH = 16
MAX_DEPTH = 8
HELD_OUT_BUCKETS = 10  # 1 prompt in 10 belongs to the held-out split
HELD_OUT_SEED = 20251122  # the published held-out set: first N held-out examples from this seed
PROMPT_MAX = 21  # longest prompt ("par:" + 16 + "=")
ANSWER_MAX = 16  # longest answer, EOS excluded


@dataclass(frozen=True)
class Example:
    task: str
    prompt: str
    answer: str  # without the EOS token


def make_cnt(rng: random.Random) -> Example:
    bits = "".join(rng.choice("01") for _ in range(CNT_BITS))
    return Example("cnt", f"cnt:{bits}=", _prefix_counts(bits))


def _prefix_counts(bits: str) -> str:
    count, out = 0, []
    for ch in bits:
        count += int(ch)
        out.append(format(count, "x"))
    return "".join(out)


def make_par(rng: random.Random) -> Example:
    bits = "".join("1" if rng.random() < PAR_ONES else "0" for _ in range(PAR_BITS))
    return Example("par", f"par:{bits}=", _running_parity(bits))


def _running_parity(bits: str) -> str:
    parity, out = 0, []
    for ch in bits:
        parity ^= int(ch)
        out.append(str(parity))
    return "".join(out)


def make_dep(rng: random.Random) -> Example:
    """A random balanced bracket string (depth <= MAX_DEPTH) and its depth profile."""
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


MAKERS: dict[str, Callable[[random.Random], Example]] = {"dep": make_dep, "cnt": make_cnt, "par": make_par}


def solve(task: str, prompt: str) -> str:
    """The reference answer of any prompt (used by scoring and tests)."""
    body = prompt.removeprefix(f"{task}:").removesuffix("=")
    if task == "cnt":
        return _prefix_counts(body)
    if task == "par":
        return _running_parity(body)
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
