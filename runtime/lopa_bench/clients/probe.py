"""The request bodies the pinned clients send with their defaults, each posted once, and lopa's answer.

A client's own report keeps only its side of a failure (guidellm records "400 Bad Request" without the
server's message), so the runner sends the same bodies itself first: the message of a refusal, and for
an accepted body whether it got exactly `max_tokens` tokens. The bodies are those of the versions in
tools/bench-clients/*.txt (guidellm 0.8.1, inference-perf 0.7.0), read from their sources and captured
on the wire; only the prompt differs (a bundled task prompt here). Each is sent a second time without
`ignore_eos` (a diagnosis: what the server says next once that field passes).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

PROMPT = "head:lkfivHT.coacwSN.ztwssIF="


@dataclass(frozen=True)
class Probe:
    name: str  # which client and setting sends this body
    path: str
    body: dict[str, Any]
    setting: str  # "<client>:<setting>", as the runner names the setting it runs (see runner.settings)
    default: bool = True  # the client's own body (False: a variant sent for diagnosis)


@dataclass(frozen=True)
class ProbeAnswer:
    name: str
    path: str
    body: dict[str, Any]
    setting: str
    default: bool
    status: int
    error: str | None  # the server's error message, when refused
    max_tokens: int | None  # asked
    completion_tokens: int | None  # usage, when answered
    finish_reason: str | None

    @property
    def exact(self) -> bool | None:
        """Whether an answered request got exactly max_tokens tokens (None: refused, or no limit sent)."""
        if self.completion_tokens is None or self.max_tokens is None:
            return None
        return self.completion_tokens == self.max_tokens

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "exact": self.exact}


def default_probes(model: str, output_tokens: int) -> list[Probe]:
    """Each client's default body for `output_tokens` tokens, then each again without ignore_eos."""
    bodies = client_bodies(model, output_tokens)
    variants = [Probe(f"{p.name}, without ignore_eos", p.path,
                      {k: v for k, v in p.body.items() if k != "ignore_eos"}, p.setting, default=False)
                for p in bodies]
    return bodies + variants


def client_bodies(model: str, output_tokens: int) -> list[Probe]:
    """guidellm streams with usage (and vLLM's continuous_usage_stats) and asks fixed-length outputs
    (ignore_eos; its stop: null is dropped from the JSON); inference-perf asks fixed-length outputs,
    unstreamed unless api.streaming is set."""
    guidellm_stream = {"include_usage": True, "continuous_usage_stats": True}
    chat = [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]
    return [
        Probe("guidellm (default request_format: chat)", "/v1/chat/completions",
              {"model": model, "stream": True, "stream_options": guidellm_stream,
               "max_completion_tokens": output_tokens, "ignore_eos": True, "messages": chat},
              "guidellm:chat"),
        Probe("guidellm (request_format /v1/completions)", "/v1/completions",
              {"model": model, "stream": True, "stream_options": guidellm_stream,
               "max_tokens": output_tokens, "ignore_eos": True, "prompt": PROMPT},
              "guidellm:completions"),
        Probe("inference-perf (default: not streamed)", "/v1/completions",
              {"model": model, "prompt": PROMPT, "max_tokens": output_tokens, "ignore_eos": True,
               "stream": False},
              "inference-perf:unstreamed"),
        Probe("inference-perf (api.streaming: true)", "/v1/completions",
              {"model": model, "prompt": PROMPT, "max_tokens": output_tokens, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True}},
              "inference-perf:streamed"),
    ]


def send(base_url: str, probe: Probe, timeout_s: float = 60.0, api_key: str | None = None) -> ProbeAnswer:
    bearer = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    headers = {"Content-Type": "application/json", **bearer}
    request = urllib.request.Request(f"{base_url}{probe.path}", data=json.dumps(probe.body).encode(),
                                     headers=headers, method="POST")
    asked = probe.body.get("max_tokens", probe.body.get("max_completion_tokens"))
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            text = reply.read().decode()
            status = reply.status
    except urllib.error.HTTPError as error:
        return ProbeAnswer(probe.name, probe.path, probe.body, probe.setting, probe.default,
                           error.code, _message(error.read().decode()), asked, None, None)
    usage, finish, error_text = _read_answer(text, bool(probe.body.get("stream")))
    return ProbeAnswer(probe.name, probe.path, probe.body, probe.setting, probe.default, status,
                       error_text, asked, usage.get("completion_tokens") if usage else None, finish)


def _message(text: str) -> str:
    try:
        error = json.loads(text).get("error")
    except (json.JSONDecodeError, AttributeError):
        return text.strip()[:500]
    if isinstance(error, dict):
        return str(error.get("message"))
    return text.strip()[:500]


def _read_answer(text: str, streamed: bool) -> tuple[dict | None, str | None, str | None]:
    """(usage, finish_reason, error message of an error event) of a JSON reply or an SSE stream."""
    if not streamed:
        reply = json.loads(text)
        choices = reply.get("choices") or [{}]
        return reply.get("usage"), choices[0].get("finish_reason"), None
    usage = finish = error = None
    for line in text.splitlines():
        if not line.startswith("data:") or line.strip() == "data: [DONE]":
            continue
        event = json.loads(line[len("data:"):])
        if "error" in event:
            error = str(event["error"].get("message"))
        usage = event.get("usage") or usage
        for choice in event.get("choices") or []:
            finish = choice.get("finish_reason") or finish
    return usage, finish, error
