"""vLLM's /tokenize and /detokenize: the served model's tokenizer, as a completion or a chat uses it.

    POST /tokenize    {"prompt": "..."} or {"messages": [...]}, optional "model", "add_special_tokens"
                      -> {"count": n, "max_model_len": L, "tokens": [...]}
    POST /detokenize  {"tokens": [...]}, optional "model" -> {"prompt": "..."}

A prompt is encoded as /v1/completions encodes it (no special tokens unless asked), messages as
/v1/chat/completions renders them (the checkpoint's chat template); nothing is queued. Errors have
OpenAI's shape and name the body field.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from lopa.model.tokenizer import chat_ids
from lopa.params import InvalidParameter
from lopa.serving.master.admission import Admission, typed
from lopa.serving.master.api import bounded_json
from lopa.serving.master.api.openai_body import ROLES, UnknownModel
from lopa.serving.master.api.openai_errors import error_response, invalid


class TokenEndpoints:
    def __init__(self, admission: Admission, names: Sequence[str], body_timeout_s: float,
                 max_body_values: int) -> None:
        self.admission, self.names = admission, tuple(names)
        self.body_timeout_s, self.max_body_values = body_timeout_s, max_body_values

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        try:
            tokens = self._tokens(body)
        except UnknownModel as error:
            return not_found(error)
        except InvalidParameter as error:
            return invalid(error.field, error.reason)
        return web.json_response({"count": len(tokens), "max_model_len": self.admission.max_length,
                                  "tokens": tokens})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        try:
            self._model(body)
            tokens = body.get("tokens")
            vocab = self.admission.vocab_size
            if not isinstance(tokens, list) or not all(_token(t, vocab) for t in tokens):
                raise InvalidParameter("tokens", f"is required: a list of token ids in [0, {vocab})")
        except UnknownModel as error:
            return not_found(error)
        except InvalidParameter as error:
            return invalid(error.field, error.reason)
        return web.json_response({"prompt": self.admission.tokenizer.decode(tokens)})

    def _tokens(self, body: dict[str, Any]) -> list[int]:
        self._model(body)
        tokenizer = self.admission.tokenizer
        if (body.get("prompt") is None) == (body.get("messages") is None):
            raise InvalidParameter("prompt", "send a prompt or messages (one of them)")
        if body.get("messages") is not None:
            messages = body["messages"]
            if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
                for m in messages
            ):
                raise InvalidParameter("messages", f"must be a non-empty list of {{role: one of "
                                                   f"{sorted(ROLES)}, content: a string}}")
            try:
                return chat_ids(tokenizer, messages)
            except InvalidParameter as error:
                raise InvalidParameter("messages", error.reason) from None
        prompt = typed("prompt", body["prompt"], (str,))
        special = bool(typed("add_special_tokens", body.get("add_special_tokens"), (bool,)))
        return list(tokenizer.encode(prompt, add_special_tokens=special))

    def _model(self, body: dict[str, Any]) -> None:
        model = typed("model", body.get("model"), (str,))
        if model is not None and model not in self.names:
            raise UnknownModel(model, self.names)

    async def _body(self, request: web.Request) -> dict[str, Any] | web.Response:
        try:
            raw = await asyncio.wait_for(request.read(), self.body_timeout_s)
            body = bounded_json.loads(raw.decode(request.charset or "utf-8"), self.max_body_values)
        except asyncio.TimeoutError:
            return error_response(408, f"body: not received within {self.body_timeout_s:g} s",
                                  "invalid_request_error", "body")
        except bounded_json.TooManyValues as error:
            return error_response(413, f"body: {error}", "invalid_request_error", "body")
        except (ValueError, LookupError, RecursionError) as error:
            return invalid("body", bounded_json.unreadable(error))
        if not isinstance(body, dict):
            return invalid("body", "must be a JSON object")
        return body


def not_found(error: UnknownModel) -> web.Response:
    """OpenAI's answer to an unknown model: 404, code model_not_found."""
    return error_response(404, error.reason, "invalid_request_error", "model", code="model_not_found")


def _token(value: Any, vocab: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab
