"""Admission: a client's request, whatever its transport, checked once into the scheduler's Request.

Each API adapter (lopa.serving.master.api) translates its own message into an `Ask`, the request
in the server's own names and not yet checked (a JSON body may carry any type). `Admission.admit`
is the only place a parameter is checked: its type, its range (DecodingParams.validate), the
server's limits, the prompt and the length; its stop strings and stop tokens by the stop policy's
checks (lopa.stops). It returns the Request the scheduler runs (the dispatcher adds the client's
callbacks); the scheduler, the decoder and the workers trust it. Every refusal is an
InvalidParameter naming the field in the server's names (the DecodingParams names, `prompt`,
`prompt_token_ids`, `messages`, `max_new_tokens`, `stop[i]`); each adapter renames them into its
own vocabulary.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from lopa.model.tokenizer import chat_ids
from lopa.params import DecodingParams, InvalidParameter, check_length, check_text, is_sequence, room_for
from lopa.scheduling.request import Request
from lopa.serving.master.served import ServedModel
from lopa.serving.shared.config import Limits
from lopa.stops import MAX_STOP_STRINGS, StopPolicy, check_stop_strings, check_stop_token_ids

# The JSON types each setting accepts (DecodingParams' annotations are strings under __future__).
_TYPES = {"int": (int,), "int | None": (int,), "float": (int, float)}
SETTING_TYPES: dict[str, tuple[type, ...]] = {
    f.name: _TYPES.get(str(f.type), (str,)) for f in fields(DecodingParams) if f.name != "max_new_tokens"
}
MAX_TOP_LOGPROBS = 20  # alternatives per answer token, as OpenAI's and vLLM's default limit
# Full-length prompts of token ids one request body may carry (a batch of shorter ones: more): what
# bounds the JSON values of a body, beside a few thousand for its other fields and chat turns.
PROMPTS_PER_BODY = 8
OTHER_VALUES = 4096
FIELDS_BYTES = 64 << 10  # room for the fields beside the prompt and the stop strings
# Integer settings travel on the gRPC wire as uint32 (uint64: the seed): a value outside cannot be
# meant, whichever transport sent it.
_INT_BITS = {"seed": 64}


@dataclass(frozen=True)
class Ask:
    """One generation request as a client sent it, in the server's names, not yet checked.

    Exactly one of prompt (text), prompt_token_ids or messages (chat turns, {role, content}, for the
    model's chat template). `decoding` holds the settings the client overrides (DecodingParams
    names). max_new_tokens: the answer's length at most; None takes the server's default, cut to
    what fits after the prompt. ignore_eos: never fill an end token, so the answer is exactly
    max_new_tokens long (min_tokens, at most that, is then met). add_special_tokens: the tokenizer
    adds its special tokens (a BOS) to a text prompt.
    """

    prompt: Any = None
    prompt_token_ids: Any = None
    messages: Any = None
    max_new_tokens: Any = None
    stop: Any = ()
    decoding: Mapping[str, Any] = field(default_factory=dict)
    pin_branches: Any = False
    ignore_eos: Any = False
    min_tokens: Any = 0
    add_special_tokens: Any = False
    stop_token_ids: Any = ()  # vLLM's: more tokens that end the answer
    include_stop_str_in_output: Any = False  # vLLM's: a stop string stays at the end of the answer
    top_logprobs: Any = 0  # each answer token's most probable alternatives (at most MAX_TOP_LOGPROBS)


class InvalidInBatch(InvalidParameter):
    """The InvalidParameter of request `index` of those admitted together."""

    def __init__(self, index: int, error: InvalidParameter) -> None:
        super().__init__(error.field, error.reason)
        self.index = index


class Admission:
    """The served model's facts and the server's limits and defaults, against which requests are
    checked. `limits`: those a request can reach (usable_limits). `max_token_chars`: the most
    characters a token stands for (served.longest_token): what bounds a text before it is tokenized."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, mask_id: int, defaults: DecodingParams, limits: Limits,
        max_length: int, max_token_chars: int = 1,
    ) -> None:
        self.tokenizer, self.vocab_size, self.mask_id = tokenizer, vocab_size, mask_id
        self.defaults, self.limits, self.max_length = defaults, limits, max_length
        # Cheap bounds, checked before any tokenizing: a longer text cannot fit the token limits.
        self.max_prompt_chars = limits.max_prompt_tokens * max_token_chars
        self.max_stop_chars = limits.max_new_tokens * max_token_chars  # the longest answer's text

    @classmethod
    def of(cls, served: ServedModel) -> Admission:
        return cls(served.tokenizer, served.config.vocab_size, served.special.mask, served.defaults,
                   served.limits, served.max_length, served.max_token_chars)

    @property
    def max_body_bytes(self) -> int:
        """The largest JSON request body worth reading: the longest prompt and stop strings a request
        can have, every character escaped (6 bytes), and room for the other fields. A batch's prompts
        together are held to it too: a longer body is mostly a flood."""
        return 6 * self._max_text_chars + FIELDS_BYTES

    @property
    def max_body_values(self) -> int:
        """The most JSON values a request body needs: the token ids of a few full-length prompts, and
        room for the other fields and chat turns."""
        return PROMPTS_PER_BODY * self.limits.max_prompt_tokens + OTHER_VALUES

    @property
    def max_message_bytes(self) -> int:
        """The largest GenerateRequest worth reading: the longest prompt and stop strings in UTF-8
        (4 bytes a character at most) or the prompt as token ids (a varint of 5 bytes at most), and
        room for the other fields."""
        ids = 5 * self.limits.max_prompt_tokens
        return max(4 * self._max_text_chars, ids) + FIELDS_BYTES

    @property
    def _max_text_chars(self) -> int:
        return self.max_prompt_chars + MAX_STOP_STRINGS * min(self.max_stop_chars, 1024)

    def admit_all(self, asks: Sequence[Ask]) -> list[Request]:
        """admit() of each; the first refusal names its request (InvalidInBatch)."""
        admitted = []
        for index, ask in enumerate(asks):
            try:
                admitted.append(self.admit(ask))
            except InvalidParameter as error:
                raise InvalidInBatch(index, error) from None
        return admitted

    def admit(self, ask: Ask) -> Request:
        params = self.params(ask)
        stop = check_stop_strings(ask.stop, self.max_stop_chars)
        ignore_eos = bool(typed("ignore_eos", ask.ignore_eos, (bool,)))
        min_tokens = wire_int("min_tokens", 0 if ask.min_tokens is None else ask.min_tokens)
        if min_tokens and not ignore_eos:
            raise InvalidParameter("min_tokens", "is supported with ignore_eos only (the end token is "
                                                 "held back for the whole answer, not a part of it)")
        ids = self.prompt_ids(ask)
        if ask.max_new_tokens is None:  # the server's default answer length, as much of it as fits
            room = room_for(len(ids), params.block_size, self.max_length)
            params = replace(params, max_new_tokens=max(1, min(params.max_new_tokens, room)))
        check_length(len(ids), params, self.max_length)
        if min_tokens > params.max_new_tokens:
            limit = params.max_new_tokens
            raise InvalidParameter("min_tokens", f"{min_tokens} exceeds max_new_tokens {limit}")
        pin = typed("pin_branches", ask.pin_branches, (bool,)) or False
        stop_ids = check_stop_token_ids(ask.stop_token_ids, self.vocab_size, self.mask_id)
        include_stop = bool(typed("include_stop_str_in_output", ask.include_stop_str_in_output, (bool,)))
        top = typed("top_logprobs", ask.top_logprobs, (int,)) or 0
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InvalidParameter("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        return Request(ids, params, StopPolicy(stop, include_stop, stop_ids), pin, ignore_eos, top)

    def params(self, ask: Ask) -> DecodingParams:
        """The server's defaults with the request's overrides, checked against the server's limits."""
        overrides = {name: setting(name, value) for name, value in ask.decoding.items() if value is not None}
        if ask.max_new_tokens is not None:
            overrides["max_new_tokens"] = wire_int("max_new_tokens", ask.max_new_tokens, lowest=1)
        branches = overrides.get("branches", self.defaults.branches)
        if branches > self.limits.max_branches:  # before the generic range check: name the server's limit
            limit = self.limits.max_branches
            raise InvalidParameter("branches", f"{branches} exceeds the server limit {limit}")
        params = self.defaults.with_overrides(**overrides)
        if params.max_new_tokens > self.limits.max_new_tokens:
            limit = self.limits.max_new_tokens
            raise InvalidParameter("max_new_tokens",
                                   f"{params.max_new_tokens} exceeds the server limit {limit}")
        return params

    def prompt_ids(self, ask: Ask) -> list[int]:
        given = [name for name in ("prompt", "prompt_token_ids", "messages") if getattr(ask, name)]
        if len(given) > 1:
            raise InvalidParameter(given[1], f"set one of {' or '.join(given)}, not both")
        if ask.prompt_token_ids:
            if is_sequence(ask.prompt_token_ids):
                self._check_count("prompt_token_ids", ask.prompt_token_ids)  # before looking at each id
            ids = token_ids(ask.prompt_token_ids)
            bad = [t for t in ids if not 0 <= t < self.vocab_size or t == self.mask_id]
            if bad:
                raise InvalidParameter("prompt_token_ids", f"ids {bad[:5]} are outside the vocabulary or the "
                                                           "mask id")
            self._check_count("prompt_token_ids", ids)
            return ids
        if ask.messages:
            chars = sum(len(str(m.get("content", ""))) for m in ask.messages if isinstance(m, dict))
            self._bound_text("messages", chars)
            ids = self._chat(ask.messages)
            self._check_count("messages", ids)
            self._check_mask("messages", ids)  # the template's text included
            return ids
        text = typed("prompt", ask.prompt, (str,)) or ""
        if not text:
            raise InvalidParameter("prompt", "is empty")
        self._bound_text("prompt", len(text))
        check_text("prompt", text)
        special = bool(typed("add_special_tokens", ask.add_special_tokens, (bool,)))
        ids = list(self.tokenizer.encode(text, add_special_tokens=special))
        self._check_count("prompt", ids)
        self._check_mask("prompt", ids)
        return ids

    def _check_mask(self, name: str, ids: list[int]) -> None:
        """Every prompt path checks its final ids: only decoding may place the mask token."""
        if self.mask_id in ids:
            raise InvalidParameter(name, f"contains the mask token (id {self.mask_id}), which only "
                                         "decoding may place")

    def _chat(self, messages: Any) -> list[int]:
        try:
            return chat_ids(self.tokenizer, messages)
        except InvalidParameter as error:
            raise InvalidParameter("messages", error.reason) from None

    def _bound_text(self, name: str, chars: int) -> None:
        """A text too long for the prompt limit whatever it says, refused before it is tokenized."""
        if chars > self.max_prompt_chars:
            raise InvalidParameter(name, f"{chars} characters cannot fit the server limit of "
                                         f"{self.limits.max_prompt_tokens} tokens (at most "
                                         f"{self.max_prompt_chars} characters)")

    def _check_count(self, name: str, ids: Any) -> None:
        if not ids:
            raise InvalidParameter(name, "is empty")
        if len(ids) > self.limits.max_prompt_tokens:
            raise InvalidParameter(name, f"{len(ids)} tokens exceed the server limit "
                                         f"{self.limits.max_prompt_tokens}")


def typed(name: str, value: Any, types: tuple[type, ...]) -> Any:
    """value when it is one of `types` (None passes), else InvalidParameter naming the field."""
    if value is None:
        return None
    # bool is an int in Python, never a number in a request
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        names = {float: "a number", int: "an integer", str: "a string", bool: "a boolean"}
        kind = " or ".join(names[t] for t in types if not (t is int and float in types))
        raise InvalidParameter(name, f"must be {kind}, got {value!r}")
    return value


def wire_int(name: str, value: Any, lowest: int = 0) -> int:
    """An integer setting within the range its wire type carries (uint32, the seed uint64)."""
    number = typed(name, value, (int,))
    if number < lowest:
        raise InvalidParameter(name, f"must be >= {lowest}, got {number}")
    if number >= 2 ** _INT_BITS.get(name, 32):
        raise InvalidParameter(name, f"is too large, got {number}")
    return number


def setting(name: str, value: Any) -> Any:
    """One decoding override, typed (its range is DecodingParams.validate's)."""
    types = SETTING_TYPES.get(name)
    if types is None:
        raise InvalidParameter(name, "is not a decoding setting")
    if types == (int,):
        return wire_int(name, value)
    value = typed(name, value, types)
    if isinstance(value, float) and math.isnan(value):  # NaN passes every range check otherwise
        raise InvalidParameter(name, "is NaN")
    return value


def token_ids(value: Any, name: str = "prompt_token_ids") -> list[int]:
    if not is_sequence(value) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise InvalidParameter(name, "must be a list of integers")
    return list(value)


def samples(ask: Ask, n: int) -> tuple[Ask, ...]:
    """`n` requests of one prompt: sample j with seed `seed + j` (mod 2^64), the request's seed or,
    without one, a fresh draw; so sample j alone is the same request with n = 1 and that seed."""
    if n == 1:
        return (ask,)
    seed = typed("seed", ask.decoding.get("seed"), (int,))
    if seed is None:
        seed = secrets.randbits(64)
    elif not 0 <= seed < 2**64:
        raise InvalidParameter("seed", f"must be in [0, 2^64), got {seed}")
    return tuple(replace(ask, decoding={**ask.decoding, "seed": (seed + j) % 2**64}) for j in range(n))
