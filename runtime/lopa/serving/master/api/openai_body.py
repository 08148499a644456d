"""OpenAI request bodies -> admission Asks (pure: no I/O, no server state).

This module checks only what OpenAI's API has and the server's own names lack: the body's shape,
`model` (one of the ids the server answers to; another is UnknownModel, a 404), `n`, `stream`,
`stream_options` (only with `stream`), the `messages` list and the OpenAI features accepted at
their defaults. Every request setting is copied into the Ask as sent and checked once, by
admission (types included). The LoPA knobs are extra body fields with the server's names; errors
name the body field, so the HTTP layer answers in OpenAI's error shape.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

from lopa.params import InvalidParameter, check_text
from lopa.serving.master.admission import SETTING_TYPES, Ask, samples, typed

# The LoPA knobs a body may carry beside OpenAI's sampling fields (all: the server's setting names).
OPENAI_SAMPLING = frozenset({"temperature", "top_p", "seed"})
LOPA_FIELDS = frozenset(SETTING_TYPES) - OPENAI_SAMPLING
# Accepted and ignored: they change nothing about the answer (stream_options is read, not ignored).
IGNORED = frozenset({"user", "stream_options", "metadata", "store"})
# Features this server lacks, accepted at their defaults (or null), which change nothing: clients and
# benchmark tools (OpenAI SDKs, vLLM's and genai-perf's) send them spelled out. Any other value is a
# 400 naming the field. Each maps to its accepted values (booleans only where a boolean is named).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},),
    "repetition_penalty": (1,),  # vLLM's extra
}
# vLLM's extras this server honours (checked by admission): benchmark clients send them.
HONOURED = frozenset({"ignore_eos", "min_tokens", "add_special_tokens", "stop_token_ids",
                      "include_stop_str_in_output"})
COMPLETION_NEUTRAL: dict[str, tuple[Any, ...]] = {"best_of": (1,), "suffix": ("",)}
CHAT_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "tools": ([],), "tool_choice": ("none",), "response_format": ({"type": "text"},),
}
# Why a feature this server lacks is refused beyond its neutral value (the 400 says it in one line).
WHY = {
    "frequency_penalty": "a penalty scores a token by the tokens before it, and a diffusion LM fills "
                         "positions in no left-to-right order",
    "presence_penalty": "a penalty scores a token by the tokens before it, and a diffusion LM fills "
                        "positions in no left-to-right order",
    "repetition_penalty": "a penalty scores a token by the tokens before it, and a diffusion LM fills "
                          "positions in no left-to-right order",
    "logit_bias": "not served",
    "best_of": "not served: ask n samples and rank them yourself",
    "suffix": "not served (no insertion)",
    "tools": "no tool calling",
    "tool_choice": "no tool calling",
    "response_format": "no structured output (JSON or schemas)",
}
COMMON = frozenset({"model", "max_tokens", "stop", "n", "stream", "pin_branches", "logprobs",
                    *LOPA_FIELDS, *OPENAI_SAMPLING, *IGNORED, *NEUTRAL, *HONOURED})
COMPLETION_FIELDS = COMMON | {"prompt", "echo", *COMPLETION_NEUTRAL}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", *CHAT_NEUTRAL}
ROLES = frozenset({"system", "user", "assistant", "developer"})


class UnknownModel(InvalidParameter):
    """The body names a model this server does not serve (404 model_not_found, as OpenAI's)."""

    def __init__(self, asked: str, served: Sequence[str]) -> None:
        names = ", ".join(repr(name) for name in served)
        super().__init__("model", f"the model {asked!r} does not exist; this server serves {names}")


@dataclass(frozen=True)
class Parsed:
    asks: tuple[Ask, ...]  # one, or one per prompt of a /v1/completions batch (choice i answers prompt i)
    stream: bool
    model: str
    include_usage: bool = False  # stream_options.include_usage: a last chunk of usage, no choices
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
    batch: bool = False  # several choices: each with its own lopa stats
    samples: int = 1  # n: the choices of each prompt (asks holds them all, prompt by prompt)
    echo: bool = False  # completions' echo: each choice's text starts with its prompt's
    logprobs: bool = False  # each returned token's logprob (docs/decoding.md section 6)
    top_logprobs: int = 0  # and its most probable alternatives (completions: logprobs N; chat: top_logprobs)


def _names(served: str | Sequence[str]) -> tuple[str, ...]:
    return (served,) if isinstance(served, str) else tuple(served)


def _common(body: Any, known: frozenset[str], served: str | Sequence[str]) -> tuple[Parsed, Ask]:
    """The fields both endpoints share; the caller adds its prompt and its token budget. `served`:
    the ids the server answers to, the main one first."""
    # long: the fields both endpoints share, checked in one place
    names = _names(served)
    if not isinstance(body, dict):
        raise InvalidParameter("body", "must be a JSON object")
    unknown = sorted(set(body) - known)
    if "prompt" in unknown and "messages" in known:  # a completions body sent to chat
        raise InvalidParameter("prompt", "is /v1/completions' field: a chat takes messages, a list of "
                                         "{role, content}")
    if unknown:
        raise InvalidParameter(unknown[0], "is not supported by this server")
    for name, accepted in {**NEUTRAL, **COMPLETION_NEUTRAL, **CHAT_NEUTRAL}.items():
        if name in known and body.get(name) is not None and not _neutral(body[name], accepted):
            shown = " or ".join(json.dumps(a) for a in accepted)
            why = f" ({WHY[name]})" if name in WHY else ""
            raise InvalidParameter(name, f"is not supported by this server: only {shown} (the default), "
                                         f"got {json.dumps(body[name])}{why}")
    model = typed("model", body.get("model"), (str,))
    if not model:
        raise InvalidParameter("model", f"is required (this server serves {names[0]!r})")
    if model not in names:
        raise UnknownModel(model, names)
    n = typed("n", body.get("n"), (int,))
    if n is not None and n < 1:
        raise InvalidParameter("n", f"must be >= 1, got {n}")
    stream = typed("stream", body.get("stream"), (bool,)) or False
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidParameter("stream_options", f"must be an object, got {json.dumps(options)}")
    if options is not None and not stream:
        raise InvalidParameter("stream_options", "is only allowed with stream: true")
    flags = {}
    for name in ("include_usage", "continuous_usage_stats"):
        try:
            flags[name] = bool(typed(name, (options or {}).get(name), (bool,)))
        except InvalidParameter as error:
            raise InvalidParameter(f"stream_options.{name}", error.reason) from None
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise InvalidParameter("stop", "must be a string or a list of strings")
    decoding = {name: body[name] for name in SETTING_TYPES if body.get(name) is not None}
    if decoding.get("top_k") == -1 and not isinstance(decoding["top_k"], bool):
        decoding["top_k"] = 0  # vLLM's spelling of "off"
    ask = Ask(
        stop=stop or (),
        decoding=decoding,
        pin_branches=body.get("pin_branches") or False,
        **{name: body[name] for name in HONOURED if body.get(name) is not None},
    )
    usage = flags["include_usage"], flags["continuous_usage_stats"]
    parsed = Parsed((), stream, model, *usage, samples=n or 1)
    return parsed, ask


def _neutral(value: Any, accepted: tuple[Any, ...]) -> bool:
    """value is one of `accepted`, a boolean only where a boolean is accepted (True == 1 in Python)."""
    def same(a: Any) -> bool:
        if isinstance(a, bool) or isinstance(value, bool):
            return value is a
        return (type(a) is type(value) or (isinstance(a, int) and isinstance(value, float))) and value == a

    return any(same(a) for a in accepted)


def completion_request(body: Any, served_model: str | Sequence[str], max_prompts: int) -> Parsed:
    """One prompt (a string or a list of token ids), or a batch: a list of several, each of which
    becomes its own request with the same settings, `n` of them per prompt (samples, see
    samples()): choice i * n + j answers prompt i, sample j. At most `max_prompts` requests in all
    (counted before any prompt is looked at)."""
    parsed, ask = _common(body, COMPLETION_FIELDS, served_model)
    ask = replace(ask, max_new_tokens=body.get("max_tokens"))
    echo = bool(typed("echo", body.get("echo"), (bool,)))
    logprobs = body.get("logprobs")
    if logprobs is not None and logprobs is not False:
        top = typed("logprobs", logprobs, (int,))  # its range: admission's top_logprobs (body_field)
        if echo:
            raise InvalidParameter("echo", "with logprobs is not served: a prompt's tokens have no "
                                           "logprob in a diffusion LM (nothing fills them)")
        parsed = replace(parsed, logprobs=True, top_logprobs=top)
        ask = replace(ask, top_logprobs=top)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        _check_count(len(prompt), parsed.samples, max_prompts)  # before any prompt is looked at
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        named = [(one, f"prompt[{i}]" if len(prompt) > 1 else "prompt") for i, one in enumerate(prompt)]
    else:
        named = [(prompt, "prompt")]
    _check_count(len(named), parsed.samples, max_prompts)
    n = parsed.samples
    asks = tuple(each for one, name in named for each in samples(_with_prompt(ask, one, name), n))
    return replace(parsed, asks=asks, batch=len(asks) > 1, echo=echo)


def _check_count(prompts: int, n: int, max_prompts: int) -> None:
    """A body's requests could never be queued at once past the queue's size: no retry helps."""
    if prompts * n > max_prompts:
        if n > 1:
            raise InvalidParameter("n", f"{prompts} prompt(s) x n = {n} exceed {max_prompts} requests per "
                                        "body (limits.queue_size)")
        raise InvalidParameter("prompt", f"at most {max_prompts} prompts per request (limits.queue_size), "
                                         f"got {prompts}")


def _with_prompt(ask: Ask, prompt: Any, name: str) -> Ask:
    if isinstance(prompt, str) and prompt:
        return replace(ask, prompt=prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in prompt):
        return replace(ask, prompt_token_ids=prompt)
    if isinstance(prompt, str):
        raise InvalidParameter(name, "is empty")
    raise InvalidParameter(name, "is required: a non-empty string or list of token ids")


def chat_request(body: Any, served_model: str | Sequence[str]) -> Parsed:
    parsed, ask = _common(body, CHAT_FIELDS, served_model)
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise InvalidParameter("max_completion_tokens", "send either it or max_tokens, not both")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidParameter("messages", "is required: a non-empty list of {role, content}")
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise InvalidParameter(f"messages[{i}].role", f"must be one of {sorted(ROLES)}")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise InvalidParameter(f"messages[{i}].content", "only text parts are supported")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise InvalidParameter(f"messages[{i}].content", "must be a string")
        check_text(f"messages[{i}].content", content)
        turns.append({"role": message["role"], "content": content})
    budget = body.get("max_completion_tokens")
    budget = body.get("max_tokens") if budget is None else budget
    logprobs = bool(typed("logprobs", body.get("logprobs"), (bool,)))
    top = typed("top_logprobs", body.get("top_logprobs"), (int,)) or 0  # its range: admission's
    if top and not logprobs:
        raise InvalidParameter("top_logprobs", "needs logprobs: true (the alternatives of each returned "
                                               "token's logprob)")
    asks = samples(replace(ask, messages=turns, max_new_tokens=budget, top_logprobs=top), parsed.samples)
    return replace(parsed, asks=asks, batch=len(asks) > 1, logprobs=logprobs, top_logprobs=top)


def body_field(field: str, chat: bool, sent: Collection[str] = ()) -> str:
    """The body field an error of admission is about (admission names the server's fields); `sent`:
    the body's fields (which of max_tokens / max_completion_tokens the client used, whether its
    stop was one string)."""
    if field == "max_new_tokens":
        return "max_completion_tokens" if "max_completion_tokens" in sent else "max_tokens"
    if field in ("prompt", "prompt_token_ids", "messages"):
        return "messages" if chat else "prompt"
    if field == "top_logprobs" and not chat:  # completions ask the alternatives' count in logprobs
        return "logprobs"
    if field.startswith("stop[") and isinstance(sent, dict) and isinstance(sent.get("stop"), str):
        return "stop"
    return field
