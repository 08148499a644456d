"""Admission: a request in the server's names -> what the scheduler runs, checked once
(lopa.serving.master.admission), and the gRPC adapter's names for its refusals."""

from __future__ import annotations

import pytest

from lopa.params import DecodingParams, InvalidParameter
from lopa.serving.client import LopaClient
from lopa.serving.master.admission import Admission, Ask
from lopa.serving.master.api.grpc_service import ask_of, field_name
from lopa.serving.master.served import usable_limits
from lopa.serving.shared.config import Limits

VOCAB, MASK = 1000, 999


class Chars:
    """A tokenizer of one id per character (ord): admission only encodes."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % VOCAB for c in text]


def admission(defaults: DecodingParams, limits: Limits, max_length: int = 256) -> Admission:
    return Admission(Chars(), VOCAB, MASK, defaults, usable_limits(limits, max_length), max_length)


def grpc_refusal(admit: Admission, **request: object) -> tuple[str, str]:
    """(field as the GenerateRequest names it, message) of the refusal of a gRPC request."""
    with pytest.raises(InvalidParameter) as error:
        admit.admit(ask_of(LopaClient.request("x", **request)))
    return field_name(error.value.field), f"{field_name(error.value.field)}: {error.value.reason}"


def test_request_overrides_within_limits() -> None:
    limits = Limits(max_branches=4, max_new_tokens=64)
    admit = admission(DecodingParams(block_size=16), limits)
    params = admit.admit(Ask(prompt="x", max_new_tokens=48, decoding={"branches": 3, "tau_conf": 0.5})).params
    assert (params.branches, params.tau_conf, params.max_new_tokens, params.block_size) == (3, 0.5, 48, 16)
    for name, value, field in [
        ("branches", 5, "decoding.branches"),
        ("tau_add", -0.1, "decoding.tau_add"),
        ("conf", "loud", "decoding.conf"),
        ("top_p", float("nan"), "decoding.top_p"),
    ]:
        with pytest.raises(InvalidParameter) as error:
            admission(DecodingParams(), limits).admit(Ask(prompt="x", decoding={name: value}))
        assert field_name(error.value.field) == field
    with pytest.raises(InvalidParameter) as error:
        admission(DecodingParams(), limits).admit(Ask(prompt="x", max_new_tokens=65))
    assert error.value.field == "max_new_tokens"


def test_types_are_checked_once_whatever_the_transport() -> None:
    """A JSON body may carry any type; admission refuses it naming the field (a bool is no number)."""
    admit = admission(DecodingParams(block_size=8, max_new_tokens=64), Limits())
    for decoding, message in [
        ({"branches": "3"}, "branches: must be an integer, got '3'"),
        ({"tau_conf": True}, "tau_conf: must be a number, got True"),
        ({"seed": -5}, "seed: must be >= 0, got -5"),
        ({"seed": 2**64}, f"seed: is too large, got {2**64}"),
        ({"top_k": 2**32}, f"top_k: is too large, got {2**32}"),
    ]:
        with pytest.raises(InvalidParameter) as error:
            admit.admit(Ask(prompt="x", decoding=decoding))
        assert str(error.value) == message
    with pytest.raises(InvalidParameter, match="max_new_tokens: must be >= 1, got 0"):
        admit.admit(Ask(prompt="x", max_new_tokens=0))


def test_usable_limits_are_capped_by_max_length() -> None:
    limits = usable_limits(Limits(max_new_tokens=1024, max_prompt_tokens=2048, max_branches=3), 256)
    assert (limits.max_new_tokens, limits.max_prompt_tokens, limits.max_branches) == (256, 256, 3)
    assert usable_limits(Limits(max_new_tokens=64, max_prompt_tokens=64), 256) == Limits(
        max_new_tokens=64, max_prompt_tokens=64
    )


@pytest.mark.parametrize(
    ("n_prompt", "request_kwargs", "field", "message"),
    [
        (10, {"max_new_tokens": 64}, None, ""),
        (250, {}, "prompt", "250 tokens leave no room for one block of 8 in max_length 256"),
        (200, {"max_new_tokens": 64}, "max_new_tokens",
         "prompt 200 + max_new_tokens 64 exceed max_length 256 in whole blocks of 8; at most 56"),
        (201, {"max_new_tokens": 50}, "max_new_tokens",
         "prompt 201 + max_new_tokens 50 exceed max_length 256 in whole blocks of 8; at most 48"),
        (10, {"ignore_eos": False, "max_new_tokens": 64}, None, ""),
    ],
)
def test_budget_checks_name_the_field_at_fault(
    n_prompt: int, request_kwargs: dict, field: str | None, message: str
) -> None:
    admit = admission(DecodingParams(block_size=8, max_new_tokens=64), Limits(max_prompt_tokens=250))
    request = LopaClient.request([5] * n_prompt, **request_kwargs)
    if field is None:
        admit.admit(ask_of(request))
        return
    with pytest.raises(InvalidParameter) as error:
        admit.admit(ask_of(request))
    name = field_name(error.value.field)
    assert (name, f"{name}: {error.value.reason}") == (field, f"{field}: {message}")


@pytest.mark.parametrize(
    ("n_prompt", "request_kwargs", "budget"),
    [
        (10, {"max_new_tokens": 4}, 4),  # below one block: a whole block decoded, 4 tokens returned
        (10, {"block_size": 80}, 64),  # a block larger than the answer
        (10, {"max_new_tokens": 17}, 17),
        (200, {}, 56),  # no max_new_tokens: the default 64, cut to what fits after the prompt
        (201, {}, 48),
    ],
)
def test_any_answer_length_is_admitted_as_asked(n_prompt: int, request_kwargs: dict, budget: int) -> None:
    admit = admission(DecodingParams(block_size=8, max_new_tokens=64), Limits(max_prompt_tokens=250))
    admitted = admit.admit(ask_of(LopaClient.request([5] * n_prompt, **request_kwargs)))
    assert admitted.params.max_new_tokens == budget


def test_ignore_eos_min_tokens_and_special_tokens() -> None:
    admit = admission(DecodingParams(block_size=8, max_new_tokens=64), Limits())
    assert admit.admit(Ask(prompt="x", ignore_eos=True, min_tokens=20, max_new_tokens=20)).ignore_eos
    for ask, message in [
        (Ask(prompt="x", min_tokens=4), "min_tokens: is supported with ignore_eos only"),
        (Ask(prompt="x", ignore_eos=True, min_tokens=30, max_new_tokens=20),
         "min_tokens: 30 exceeds max_new_tokens 20"),
        (Ask(prompt="x", ignore_eos="yes"), "ignore_eos: must be a boolean, got 'yes'"),
        (Ask(prompt="x", add_special_tokens=1), "add_special_tokens: must be a boolean, got 1"),
    ]:
        with pytest.raises(InvalidParameter) as error:
            admit.admit(ask)
        assert str(error.value).startswith(message), str(error.value)
