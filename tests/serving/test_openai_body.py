"""OpenAI bodies -> admission Asks (pure): features this server lacks are accepted only at their
defaults, on the endpoint that has them; anything else is an error naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from lopa.params import InvalidParameter
from lopa.serving.master.api.openai_body import chat_request, completion_request

MODEL = "m"


def chat(**fields: Any) -> Any:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    return chat_request(body, MODEL)


def completion(**fields: Any) -> Any:
    return completion_request({"model": MODEL, "prompt": "hi", **fields}, MODEL, max_prompts=64)


def test_defaults_and_nulls_give_the_plain_request() -> None:
    plain_chat, plain_completion = chat().asks, completion().asks
    spelled_out = chat(logprobs=False, top_logprobs=0, tools=[], tool_choice="none",
                       response_format={"type": "text"}, presence_penalty=0, frequency_penalty=0.0,
                       logit_bias={}, repetition_penalty=1.0, ignore_eos=False, min_tokens=0)
    assert spelled_out.asks == plain_chat
    assert chat(logprobs=None, tools=None, response_format=None).asks == plain_chat
    spelled_out = completion(logprobs=False, best_of=1, echo=False, suffix="", presence_penalty=0.0)
    assert spelled_out.asks == plain_completion
    assert completion(logprobs=None, best_of=None, echo=None).asks == plain_completion
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage
    assert not completion(stream=True, stream_options={}).include_usage


@pytest.mark.parametrize(
    ("call", "fields", "field", "reason"),
    [
        (chat, {"top_logprobs": 3}, "top_logprobs", "needs logprobs: true"),
        (chat, {"prompt": "hi"}, "prompt", "a chat takes messages"),
        (completion, {"logprobs": 2.5}, "logprobs", "must be an integer"),  # the alternatives' count
        (chat, {"tools": [{"type": "function"}]}, "tools", "only [] (the default)"),
        (chat, {"response_format": {"type": "json_object"}}, "response_format", 'only {"type": "text"}'),
        (chat, {"echo": False}, "echo", "is not supported by this server"),  # a completions field
        (completion, {"top_logprobs": 0}, "top_logprobs", "is not supported by this server"),  # a chat field
        (completion, {"best_of": True}, "best_of", "only 1 (the default), got true"),  # a boolean is no count
        (completion, {"echo": 0}, "echo", "must be a boolean, got 0"),
        (completion, {"frequency_penalty": "0"}, "frequency_penalty", 'only 0 (the default), got "0"'),
        (completion, {"repetition_penalty": 1.2}, "repetition_penalty", "only 1 (the default), got 1.2"),
        (completion, {"stream_options": True}, "stream_options", "must be an object, got true"),
        (completion, {"stream": True, "stream_options": {"include_usage": "yes"}},
         "stream_options.include_usage", "must be a boolean"),
        (completion, {"stream_options": {"include_usage": True}}, "stream_options",
         "only allowed with stream"),
        (chat, {"stream": False, "stream_options": {}}, "stream_options", "only allowed with stream"),
    ],
)
def test_other_values_name_the_field(call: Any, fields: dict[str, Any], field: str, reason: str) -> None:
    with pytest.raises(InvalidParameter) as caught:
        call(**fields)
    assert caught.value.field == field and reason in caught.value.reason, caught.value.reason


def test_the_options_benchmark_clients_send_reach_admission() -> None:
    """vLLM's extras that inference-perf and guidellm send are carried to admission as sent."""
    sent = {"ignore_eos": True, "min_tokens": 10, "max_tokens": 10, "add_special_tokens": True, "echo": False}
    ask = completion(**sent).asks[0]
    assert (ask.ignore_eos, ask.min_tokens, ask.max_new_tokens) == (True, 10, 10) and ask.add_special_tokens
    options = {"include_usage": True, "continuous_usage_stats": True}
    parsed = completion(stream=True, stream_options=options)
    assert parsed.include_usage and parsed.continuous_usage
    assert not completion(stream=True, stream_options={"include_usage": True}).continuous_usage
