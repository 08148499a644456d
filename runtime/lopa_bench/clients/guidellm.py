"""guidellm (vllm-project): its scenario file and its JSON report.

Defaults it keeps here: backend openai_http (HTTP/2 allowed, streaming, validates GET /health), the
request bodies of `probe.default_probes`, tokens counted from the server's `usage`
(`prefer_response_metrics`), warmup and cooldown off. Chosen: target, model, tokenizer directory,
synthetic_text data of fixed prompt / output lengths, a constant rate for a duration. guidellm's default
request format is /v1/chat/completions, which `lopa bench clients` keeps (the bundled model has a chat
template); `endpoint="completions"` sends /v1/completions instead (a model without a chat template
answers chat with a 400).

Its report (`benchmarks[].requests.{successful,errored,incomplete}`) holds every request with its
computed fields: time_to_first_token_ms (request sent to the first SSE line with text),
inter_token_latency_ms ((last text line - first) / (output tokens - 1): vLLM's TPOT) and
time_per_output_token_ms (request sent to last text line / output tokens). Its summary means of the
per-token metrics are weighted by tokens; the comparison uses per-request means.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from lopa_bench.clients.results import ClientRun, Failure, Load, Target, mean

NAME = "guidellm"
REPORT = "benchmarks.json"
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def scenario(target: Target, load: Load, report: Path, endpoint: str = "completions",
             compat: bool = False) -> dict[str, Any]:
    """`compat`: add `ignore_eos: false` to every body (guidellm sends true with fixed output lengths)."""
    backend: dict[str, Any] = {"kind": "openai_http", "target": target.base_url, "model": target.model}
    if endpoint != "chat":
        backend["request_format"] = ENDPOINTS[endpoint]
    if compat:
        backend["extras"] = {"body": {"ignore_eos": False}}
    if target.api_key:
        backend["api_key"] = target.api_key  # the openai_http backend's Bearer token
    return {"spec": {
        "backend": backend,
        "profile": {"kind": "constant", "rate": [load.rate]},
        "constraints": [{"kind": "max_duration", "seconds": load.seconds}],
        "tokenizer": {"kind": "huggingface_auto", "model": str(target.tokenizer)},
        "data": [{"kind": "synthetic_text", "prompt_tokens": load.prompt_tokens,
                  "output_tokens": load.output_tokens}],
        "outputs": [{"kind": "json", "path": str(report)}],
    }}


def prepare(venv: Path, target: Target, load: Load, work: Path, endpoint: str = "completions",
            compat: bool = False) -> list[str]:
    """Writes the scenario into `work`; returns the command that runs it."""
    path = work / "scenario.json"
    path.write_text(json.dumps(scenario(target, load, work / REPORT, endpoint, compat), indent=2) + "\n")
    return [str(venv / "bin" / "guidellm"), "run", "--scenario", str(path), "--disable-progress"]


_STATUS = re.compile(r"'(\d{3} [^']*)'")


def parse(work: Path) -> ClientRun:
    path = work / REPORT
    run = ClientRun(NAME, report=str(path))
    data = json.loads(path.read_text())
    successful: list[dict] = []
    for benchmark in data.get("benchmarks", []):
        requests = benchmark.get("requests") or {}
        successful += requests.get("successful") or []
        run.incomplete += len(requests.get("incomplete") or [])
        for request in requests.get("errored") or []:
            text = str((request.get("info") or {}).get("error") or "unknown error")
            found = _STATUS.search(text)
            failure = run.failures.setdefault(f"HTTP {found.group(1)}" if found else "error", Failure())
            failure.count += 1
            message = text.split("\\n")[0].splitlines()[0][:300]  # httpx's repr: first line only
            if message not in failure.messages and len(failure.messages) < 5:
                failure.messages.append(message)
            run.failed += 1
        run.headline.update(_headline(benchmark.get("metrics") or {}))
    run.ok = len(successful)
    if successful:
        run.prompt_tokens = float(sum(r.get("prompt_tokens") or 0 for r in successful))
        run.output_tokens = float(sum(r.get("output_tokens") or 0 for r in successful))
        run.usage_output_tokens = run.output_tokens  # guidellm takes output tokens from usage
        asked = [_asked(r) for r in successful]
        if all(a is not None for a in asked):
            run.asked_tokens = float(sum(a for a in asked if a is not None))
        run.not_exact = sum(1 for r, a in zip(successful, asked, strict=True)
                            if a is not None and r.get("output_tokens") != a)
        ttft = [r["time_to_first_token_ms"] / 1000 for r in successful if r.get("time_to_first_token_ms")]
        tpot = [r["inter_token_latency_ms"] / 1000 for r in successful if r.get("inter_token_latency_ms")]
        run.ttft_s, run.tpot_s = mean(ttft), mean(tpot)
    return run


def _asked(request: dict) -> int | None:
    try:
        body = json.loads(request.get("request_args") or "{}").get("body") or {}
    except json.JSONDecodeError:
        return None
    asked = body.get("max_tokens", body.get("max_completion_tokens"))
    return asked if isinstance(asked, int) else None


def _headline(metrics: dict) -> dict[str, Any]:
    """guidellm's own summary: TTFT per request, ITL and TPOT weighted by tokens, token totals."""
    def successful(name: str, stat: str) -> Any:
        return ((metrics.get(name) or {}).get("successful") or {}).get(stat)

    return {"ttft_ms_mean": successful("time_to_first_token_ms", "mean"),
            "itl_ms_mean_token_weighted": successful("inter_token_latency_ms", "mean"),
            "tpot_ms_mean_token_weighted": successful("time_per_output_token_ms", "mean"),
            "prompt_tokens_total": successful("prompt_token_count", "total_sum"),
            "output_tokens_total": successful("output_token_count", "total_sum")}
