"""What one client run reported, in one shape whatever the client (read from its JSON report)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Load:
    """The load both clients are given: a constant request rate for a while, fixed prompt and output
    lengths (in the model's tokens)."""

    # A load that keeps the 2-worker CPU group busy (a queue forms, TTFT of tens to hundreds of
    # ms), so the clients' own overhead (a few ms per request) stays small beside what is compared.
    rate: float = 18.0  # requests per second
    seconds: int = 20
    prompt_tokens: int = 64
    output_tokens: int = 64


@dataclass(frozen=True)
class Target:
    base_url: str  # http://host:port, no /v1
    model: str  # the served model id (as /v1/models lists it)
    tokenizer: Path  # a local Hugging Face tokenizer directory
    api_key: str | None = None  # the server's API key (a Bearer token), if it has one


@dataclass
class Failure:
    count: int = 0
    messages: list[str] = field(default_factory=list)  # distinct, as the client recorded them


@dataclass
class ClientRun:
    client: str
    ok: int = 0  # requests the client counts as successful
    failed: int = 0  # requests the client counts as errored
    incomplete: int = 0  # requests the client cancelled when its run ended (not failures)
    failures: dict[str, Failure] = field(default_factory=dict)  # by the client's label (e.g. status)
    prompt_tokens: float | None = None  # total over successful requests, as the client reports it
    output_tokens: float | None = None  # total, as the client reports it (both clients: the server's usage)
    output_tokens_client: float | None = None  # total, re-tokenized by the client (inference-perf only)
    usage_output_tokens: float | None = None  # total of the usage.completion_tokens the client received
    asked_tokens: float | None = None  # total max_tokens of the successful requests
    not_exact: int = 0  # successful requests whose usage.completion_tokens != their max_tokens
    ttft_s: float | None = None  # per-request mean, the client's definition
    tpot_s: float | None = None  # per-request mean of (last token - first token) / (tokens - 1)
    headline: dict[str, Any] = field(default_factory=dict)  # the client's own summary numbers
    report: str = ""  # where the client wrote its report
    log: str = ""  # the client's output
    exit_status: int | None = 0  # None: killed past its time limit
    error: str | None = None  # no readable report

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
