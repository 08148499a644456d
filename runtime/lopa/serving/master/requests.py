"""Client request -> validated job inputs. Pure: every error is InvalidParameter naming the field."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from lopa.params import DecodingParams, InvalidParameter, check_length
from lopa.proto import lopa_pb2
from lopa.serving.shared.config import Limits

_OVERRIDES = [f.name for f in fields(DecodingParams) if f.name != "max_new_tokens"]


@dataclass(frozen=True)
class ValidRequest:
    """A client request that passed every check: what the scheduler may run."""

    prompt_ids: list[int]
    params: DecodingParams
    stop: tuple[str, ...]
    pin_branches: bool = False


def overrides_of(message: lopa_pb2.DecodingOverrides) -> dict[str, Any]:
    return {name: getattr(message, name) for name in _OVERRIDES if message.HasField(name)}


def build_params(
    request: lopa_pb2.GenerateRequest, defaults: DecodingParams, limits: Limits
) -> DecodingParams:
    """Server defaults + the request's overrides, checked against the server limits."""
    overrides = overrides_of(request.decoding)
    if request.HasField("max_new_tokens"):
        overrides["max_new_tokens"] = request.max_new_tokens
    for name, value in overrides.items():
        if isinstance(value, float) and value != value:  # NaN passes every range check otherwise
            raise InvalidParameter(f"decoding.{name}", "is NaN")
    branches = overrides.get("branches", defaults.branches)
    if branches > limits.max_branches:  # before the generic range check: name the server's limit
        limit = limits.max_branches
        raise InvalidParameter("decoding.branches", f"{branches} exceeds the server limit {limit}")
    try:
        params = defaults.with_overrides(**overrides)
    except InvalidParameter as error:
        raise InvalidParameter(_field(error.field), error.reason) from None
    if params.max_new_tokens > limits.max_new_tokens:
        raise InvalidParameter(
            "max_new_tokens", f"{params.max_new_tokens} exceeds the server limit {limits.max_new_tokens}"
        )
    return params


def check_prompt(
    ids: list[int], vocab_size: int, mask_id: int, limits: Limits, from_text: bool = False
) -> None:
    """from_text: the ids are the tokenized `prompt` (errors name it, not prompt_token_ids)."""
    if not ids:
        raise InvalidParameter("prompt", "is empty")
    if len(ids) > limits.max_prompt_tokens:
        limit = limits.max_prompt_tokens
        raise InvalidParameter("prompt", f"{len(ids)} tokens exceed the server limit {limit}")
    if from_text:
        if mask_id in ids:
            reason = f"contains the mask token (id {mask_id}), which only decoding may place"
            raise InvalidParameter("prompt", reason)
        return  # the tokenizer's ids are in its vocabulary
    bad = [t for t in ids if not 0 <= t < vocab_size or t == mask_id]
    if bad:
        raise InvalidParameter("prompt_token_ids", f"ids {bad[:5]} are outside the vocabulary or the mask id")


def usable_limits(limits: Limits, max_length: int) -> Limits:
    """The limits a request can actually reach: no prompt or answer is longer than the KV cache."""
    return replace(
        limits,
        max_new_tokens=min(limits.max_new_tokens, max_length),
        max_prompt_tokens=min(limits.max_prompt_tokens, max_length),
    )


def check_budget(
    n_prompt: int, params: DecodingParams, max_length: int, request: lopa_pb2.GenerateRequest
) -> None:
    """Block size, prompt and max_new_tokens against max_length, naming the field at fault."""
    block, new = params.block_size, params.max_new_tokens
    if new < block:  # generation grows in whole blocks
        if request.decoding.HasField("block_size") and not request.HasField("max_new_tokens"):
            raise InvalidParameter("decoding.block_size", f"{block} is more than max_new_tokens {new}")
        raise InvalidParameter("max_new_tokens", f"{new} is less than block_size {block}")
    check_length(n_prompt, params, max_length)


def check_stop(stop: list[str]) -> tuple[str, ...]:
    if any(not s for s in stop):
        raise InvalidParameter("stop", "stop sequences must be non-empty")
    return tuple(stop)


def _field(name: str) -> str:
    return name if name == "max_new_tokens" else f"decoding.{name}"
