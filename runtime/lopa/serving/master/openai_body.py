"""OpenAI request bodies -> the client API's GenerateRequest (pure: no I/O, no server state).

`/v1/completions` and `/v1/chat/completions` bodies map onto the same GenerateRequest a gRPC client
sends, so both transports share one validation and one request pipeline. OpenAI fields map where
they exist (prompt / messages, max_tokens, stop, temperature, top_p, seed, n = 1, stream); the LoPA
knobs are extra body fields with the gRPC override names. Errors are InvalidParameter naming the
body field (never a proto path), so the HTTP layer can answer in OpenAI's error shape.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any

from google.protobuf.descriptor import FieldDescriptor

from lopa.params import InvalidParameter
from lopa.proto import lopa_pb2

# The LoPA knobs a body may carry, with the JSON types they accept (the ranges are the server's).
LOPA_FIELDS: dict[str, tuple[type, ...]] = {
    "branches": (int,), "block_size": (int,), "tau_add": (int, float), "tau_act": (int, float),
    "tau_conf": (int, float), "conf": (str,), "alpha": (int, float), "beta": (int, float),
    "attention": (str,), "top_k": (int,),
}
OPENAI_SAMPLING: dict[str, tuple[type, ...]] = {"temperature": (int, float), "top_p": (int, float),
                                                 "seed": (int,)}
# Accepted and ignored: they change nothing about the answer (stream_options is read, not ignored).
IGNORED = frozenset({"user", "stream_options", "metadata", "store"})
# Features this server lacks, accepted at their defaults (or null), which change nothing: clients and
# benchmark tools (OpenAI SDKs, vLLM's and genai-perf's) send them spelled out. Any other value is a
# 400 naming the field. Each maps to its accepted values (booleans only where a boolean is named;
# completions' logprobs: 0 asks for the sampled tokens' logprobs, so only false or null pass).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},), "logprobs": (False,),
    "repetition_penalty": (1,), "ignore_eos": (False,), "min_tokens": (0,),  # vLLM's extras
}
COMPLETION_NEUTRAL: dict[str, tuple[Any, ...]] = {"best_of": (1,), "echo": (False,), "suffix": ("",)}
CHAT_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "top_logprobs": (0,), "tools": ([],), "tool_choice": ("none",), "response_format": ({"type": "text"},),
}
COMMON = frozenset({"model", "max_tokens", "stop", "n", "stream", "pin_branches",
                    *LOPA_FIELDS, *OPENAI_SAMPLING, *IGNORED, *NEUTRAL})
COMPLETION_FIELDS = COMMON | {"prompt", *COMPLETION_NEUTRAL}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", *CHAT_NEUTRAL}
ROLES = frozenset({"system", "user", "assistant", "developer"})


@dataclass(frozen=True)
class Parsed:
    request: lopa_pb2.GenerateRequest
    stream: bool
    model: str
    include_usage: bool = False  # stream_options.include_usage: a last chunk of usage, no choices
    batch: tuple[lopa_pb2.GenerateRequest, ...] = ()  # /v1/completions with several prompts: one each

    @property
    def requests(self) -> tuple[lopa_pb2.GenerateRequest, ...]:
        return self.batch or (self.request,)


def _typed(body: dict[str, Any], name: str, types: tuple[type, ...]) -> Any:
    value = body.get(name)
    if value is None:
        return None
    # bool is an int in Python, never a number in a request
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        names = {float: "a number", int: "an integer", str: "a string", bool: "a boolean"}
        kind = " or ".join(names[t] for t in types if not (t is int and float in types))
        raise InvalidParameter(name, f"must be {kind}, got {value!r}")
    return value


def _common(body: dict[str, Any], known: frozenset[str], served_model: str) -> Parsed:
    """The fields both endpoints share; the caller adds its prompt and its token budget."""
    if not isinstance(body, dict):
        raise InvalidParameter("body", "must be a JSON object")
    unknown = sorted(set(body) - known)
    if unknown:
        raise InvalidParameter(unknown[0], "is not supported by this server")
    for name, accepted in {**NEUTRAL, **COMPLETION_NEUTRAL, **CHAT_NEUTRAL}.items():
        if name in known and body.get(name) is not None and not _neutral(body[name], accepted):
            shown = " or ".join(json.dumps(a) for a in accepted)
            raise InvalidParameter(name, f"is not supported by this server: only {shown} (the default), "
                                         f"got {json.dumps(body[name])}")
    model = _typed(body, "model", (str,))
    if not model:
        raise InvalidParameter("model", f"is required (this server serves {served_model!r})")
    if model != served_model:
        raise InvalidParameter("model", f"unknown model {model!r}; this server serves {served_model!r}")
    n = _typed(body, "n", (int,))
    if n is not None and n != 1:
        raise InvalidParameter("n", f"only n = 1 is supported, got {n}")
    stream = _typed(body, "stream", (bool,)) or False
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidParameter("stream_options", f"must be an object, got {json.dumps(options)}")
    try:
        include_usage = _typed(options or {}, "include_usage", (bool,))
    except InvalidParameter as error:
        raise InvalidParameter("stream_options.include_usage", error.reason) from None
    request = lopa_pb2.GenerateRequest(pin_branches=bool(_typed(body, "pin_branches", (bool,))))
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise InvalidParameter("stop", "must be a string or a list of strings")
    listed = isinstance(body.get("stop"), list)
    for i, text in enumerate(stop or []):
        _check_text(f"stop[{i}]" if listed else "stop", text)
    request.stop.extend(stop or [])
    for name, types in {**OPENAI_SAMPLING, **LOPA_FIELDS}.items():
        value = _typed(body, name, types)
        if value is not None:
            _assign(request.decoding, name, value)
    return Parsed(request, stream, model, bool(include_usage))


def _neutral(value: Any, accepted: tuple[Any, ...]) -> bool:
    """value is one of `accepted`, a boolean only where a boolean is accepted (True == 1 in Python)."""
    def same(a: Any) -> bool:
        if isinstance(a, bool) or isinstance(value, bool):
            return value is a
        return (type(a) is type(value) or (isinstance(a, int) and isinstance(value, float))) and value == a

    return any(same(a) for a in accepted)


def _assign(message: Any, name: str, value: Any, body_name: str | None = None) -> None:
    """message.name = value; the range errors protobuf would raise (negative into unsigned) named
    after the body field (`body_name`, default `name`)."""
    try:
        setattr(message, name, value)
    except (ValueError, TypeError) as error:
        # Only the wire type's bounds are known here, not the server's limits (checked later, when
        # the value fits): an integer above its type's range is just too large.
        lowest = _INT_LOWEST.get(message.DESCRIPTOR.fields_by_name[name].cpp_type)
        if lowest is None or not isinstance(value, int):
            why = f"is out of range ({error})"
        else:
            why = f"must be >= {lowest}" if value < lowest else "is too large"
        raise InvalidParameter(body_name or name, f"{why}, got {value!r}") from None


_INT_LOWEST = {FieldDescriptor.CPPTYPE_UINT32: 0, FieldDescriptor.CPPTYPE_INT32: -(2**31),
               FieldDescriptor.CPPTYPE_UINT64: 0, FieldDescriptor.CPPTYPE_INT64: -(2**63)}


def _check_text(name: str, text: str) -> None:
    """JSON may carry a lone UTF-16 surrogate ("\\ud800"), which no UTF-8 text (or protobuf string)
    can hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = text[error.start : error.end].encode("unicode_escape").decode()
        reason = f"is not valid Unicode text: a lone surrogate {bad} at index {error.start}"
        raise InvalidParameter(name, reason) from None


def _max_tokens(body: dict[str, Any], request: lopa_pb2.GenerateRequest, name: str) -> None:
    value = _typed(body, name, (int,))
    if value is None:
        return
    if value < 1:
        raise InvalidParameter(name, f"must be >= 1, got {value}")
    _assign(request, "max_new_tokens", value, name)


def completion_request(body: Any, served_model: str) -> Parsed:
    """One prompt (a string or a list of token ids), or a batch: a list of several, each of which
    becomes its own request with the same settings (choice i answers prompt i)."""
    parsed = _common(body, COMPLETION_FIELDS, served_model)
    request = parsed.request
    _max_tokens(body, request, "max_tokens")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) == 1:  # a batch of one
            _set_prompt(request, prompt[0], "prompt")
            return parsed
        batch = []
        for i, one in enumerate(prompt):
            each = lopa_pb2.GenerateRequest()
            each.CopyFrom(request)
            _set_prompt(each, one, f"prompt[{i}]")
            batch.append(each)
        return replace(parsed, batch=tuple(batch))
    _set_prompt(request, prompt, "prompt")
    return parsed


def _set_prompt(request: lopa_pb2.GenerateRequest, prompt: Any, name: str) -> None:
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidParameter(name, "is empty")
        _check_text(name, prompt)
        request.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                     for t in prompt):
        try:
            request.prompt_token_ids.extend(prompt)
        except ValueError:
            raise InvalidParameter(name, "token ids must fit in 32 bits") from None
    else:
        raise InvalidParameter(name, "is required: a non-empty string or list of token ids")


def chat_request(body: Any, served_model: str, render: Callable[[list[dict[str, str]]], list[int]]) -> Parsed:
    """render: messages -> prompt ids through the model's chat template (InvalidParameter when it
    has none)."""
    parsed = _common(body, CHAT_FIELDS, served_model)
    request = parsed.request
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
        _check_text(f"messages[{i}].content", content)
        turns.append({"role": message["role"], "content": content})
    try:
        ids = render(turns)
    except InvalidParameter as error:
        raise InvalidParameter("messages", error.reason) from None
    request.prompt_token_ids.extend(ids)
    _max_tokens(body, request, "max_tokens")
    _max_tokens(body, request, "max_completion_tokens")
    return parsed


def body_field(field: str, chat: bool, sent: Collection[str] = ()) -> str:
    """The body field an error of the shared pipeline is about (its names are the gRPC ones);
    `sent`: the body's fields (which of max_tokens / max_completion_tokens the client used)."""
    name = field.removeprefix("decoding.")
    if name == "max_new_tokens":
        return "max_completion_tokens" if "max_completion_tokens" in sent else "max_tokens"
    if name in ("prompt", "prompt_token_ids", "chat"):
        return "messages" if chat else "prompt"
    return name
