"""Decoding parameters: the knobs of docs/decoding.md with the paper's defaults, validated once."""

from __future__ import annotations

import enum
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any


class AttentionMode(str, enum.Enum):
    FULL = "full"  # LoPA default: window tokens see every window token
    BLOCK_CAUSAL = "block_causal"  # original D2F: block b sees the prompt and blocks 0..b


class ConfKind(str, enum.Enum):
    PROB = "prob"  # P(x_hat)
    NEG_ENTROPY = "neg_entropy"  # sum p*log(p+1e-10); Dream's default
    MARGIN = "margin"  # top1 - top2


class BranchScore(str, enum.Enum):
    """How a branch's verification is scored (docs/decoding.md section 4 step 5)."""

    MEAN = "mean"  # the paper's Eq. 2: mean of the lowest beta fraction of future Conf values
    BLOCK_MIN = "block_min"  # the least confident block's mean Conf
    FILLS = "fills"  # the tokens the round would commit: its lookahead and every P > tau_conf


class BranchPolicy(str, enum.Enum):
    """How many lookahead branches a round spawns (docs/decoding.md section 4 step 8)."""

    FIXED = "fixed"  # the paper's: `branches` every round
    AUTO = "auto"  # `branches` after a stalled anchor fill, fewer after one that filled much


class InvalidParameter(ValueError):
    """A parameter is out of range: `field` names it, `reason` says why (the message is both, for
    the gRPC status; the CLI and the HTTP API name the field their own way, with the same reason)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


MAX_BRANCHES = 64  # hard ceiling; servers configure a lower limit
# The settings that take one of a set of names, and their enums.
CHOICE_SETTINGS: dict[str, type[enum.Enum]] = {
    "conf": ConfKind, "branch_score": BranchScore, "branch_policy": BranchPolicy, "attention": AttentionMode,
}


@dataclass(frozen=True)
class DecodingParams:
    """Everything that decides which tokens get filled. Defaults follow the paper (Table 5)."""

    block_size: int = 32
    max_new_tokens: int = 256  # the answer's length at most; decoded in whole blocks (decoded_tokens)
    tau_add: float = 0.1  # append a block once the last block is this decoded
    tau_act: float = 0.95  # fully activate block j+1 once block j is this decoded
    tau_conf: float = 0.9  # fill positions with P > tau_conf (strict)
    branches: int = 0  # k lookahead branches; 0 is the D2F baseline
    conf: ConfKind = ConfKind.NEG_ENTROPY
    alpha: float = 0.0  # weight of the branch-creation confidence in the score
    beta: float = 1.0  # fraction of lowest future Conf values averaged (1 = plain mean)
    branch_score: BranchScore = BranchScore.MEAN
    branch_policy: BranchPolicy = BranchPolicy.FIXED  # auto: `branches` is the ceiling
    attention: AttentionMode = AttentionMode.FULL
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # keep tokens of P >= min_p x the top token's (after top-k); 0 = off
    seed: int | None = None  # sampling seed; None: a fresh one per request (seeded())

    def __post_init__(self) -> None:
        self._coerce_choices()
        self.validate()

    def _coerce_choices(self) -> None:
        """The choice settings as their enums (from their names); InvalidParameter names an unknown one."""
        for name, kind in CHOICE_SETTINGS.items():
            try:
                object.__setattr__(self, name, kind(getattr(self, name)))
            except ValueError:
                choices = ", ".join(k.value for k in kind)
                got = getattr(self, name)
                raise InvalidParameter(name, f"must be one of {choices}, got {got!r}") from None

    def validate(self, max_branches: int = MAX_BRANCHES) -> None:
        """Raise InvalidParameter naming the first bad field."""
        if self.block_size < 1:
            raise InvalidParameter("block_size", f"must be >= 1, got {self.block_size}")
        if self.max_new_tokens < 1:
            raise InvalidParameter("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        for name in ("tau_add", "tau_act", "tau_conf", "alpha", "min_p"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise InvalidParameter(name, f"must be in [0, 1], got {value}")
        # Fractions that must keep something: of the Conf values averaged, of the probability mass.
        for name in ("beta", "top_p"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise InvalidParameter(name, f"must be in (0, 1], got {value}")
        if not 0 <= self.branches <= max_branches:
            raise InvalidParameter("branches", f"must be in [0, {max_branches}], got {self.branches}")
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise InvalidParameter("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if not 0 <= self.top_k < 2**32:  # the wire carries it as uint32
            raise InvalidParameter("top_k", f"must be in [0, 2^32), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**64:  # the wire carries it as uint64
            raise InvalidParameter("seed", f"must be in [0, 2^64), got {self.seed}")

    @classmethod
    def trusted(cls, **values: object) -> DecodingParams:
        """Settings someone upstream already checked (a worker rebuilding what its master admitted):
        the defaults with `values`, not validated again."""
        params = object.__new__(cls)
        for f in fields(cls):
            object.__setattr__(params, f.name, values.get(f.name, f.default))
        params._coerce_choices()
        return params

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def seeded(self) -> DecodingParams:
        """These settings with a seed: the given one, else a fresh draw. As OpenAI's API and vLLM's:
        a request that names no seed samples anew; one that does is reproducible."""
        return self if self.seed is not None else replace(self, seed=secrets.randbits(64))

    def with_overrides(self, **overrides: object) -> DecodingParams:
        """A copy with the given fields replaced (None values ignored), validated."""
        known = {f.name for f in fields(self)}
        for name in overrides:
            if name not in known:
                raise InvalidParameter(name, "unknown decoding parameter")
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


def decoded_tokens(max_new_tokens: int, block_size: int) -> int:
    """The generated positions decoded for an answer of at most max_new_tokens: whole blocks (the
    answer is their first max_new_tokens tokens)."""
    return -(-max_new_tokens // block_size) * block_size


def room_for(prompt_tokens: int, block_size: int, max_length: int) -> int:
    """The longest answer that fits after the prompt: the whole blocks left in max_length."""
    return max(0, max_length - prompt_tokens) // block_size * block_size


def check_length(prompt_tokens: int, params: DecodingParams, max_length: int) -> None:
    """A prompt and its answer's whole blocks against the model's length limit, naming the field at
    fault (the decoder itself would stop at the limit: a caller asking for more is told instead)."""
    block, new = params.block_size, params.max_new_tokens
    room = room_for(prompt_tokens, block, max_length)
    if room == 0:
        why = f"leave no room for one block of {block} in max_length {max_length}"
        raise InvalidParameter("prompt", f"{prompt_tokens} tokens {why}")
    if decoded_tokens(new, block) > room:
        raise InvalidParameter(
            "max_new_tokens",
            f"prompt {prompt_tokens} + max_new_tokens {new} exceed max_length {max_length} in whole "
            f"blocks of {block}; at most {room}",
        )


def is_sequence(value: Any) -> bool:
    """A list of a JSON body or a repeated field of a protobuf message (not a string)."""
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def check_text(name: str, text: str) -> None:
    """JSON may carry a lone UTF-16 surrogate ("\\ud800"), which no UTF-8 text can hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = text[error.start : error.end].encode("unicode_escape").decode()
        reason = f"is not valid Unicode text: a lone surrogate {bad} at index {error.start}"
        raise InvalidParameter(name, reason) from None
