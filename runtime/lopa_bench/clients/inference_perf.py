"""inference-perf (kubernetes-sigs): its config file and its JSON reports.

Defaults it keeps here: server type vllm (model auto-detected from GET /v1/models unless given;
`ignore_eos: true`), completion API, `num_workers` = CPU count, no retries, no request timeout, the
request bodies of `probe.default_probes`. Chosen: base URL, model, tokenizer directory, random data
(tokens drawn from the tokenizer's vocabulary) of fixed prompt / output lengths, one constant-rate
stage. Its default is not to stream (`api.streaming: false`), which measures no TTFT or TPOT at all:
`streaming=True` (the runner's default) sets `api.streaming: true`, which adds
`stream_options.include_usage` to each body. The per-request report is switched on to count tokens
request by request.

Its summary (`summary_lifecycle_metrics.json`) counts prompt tokens from `usage.prompt_tokens` and
output tokens from `usage.completion_tokens` (client re-tokenization where usage is missing);
time_to_first_token is request sent to the first SSE event with text, time_per_output_token
(last text event - first) / (output tokens - 1), the tokens re-tokenized from the text by the client
unless `report.request_lifecycle.use_server_output_tokens`. Failures are grouped by label
("400 - other") with the server's error messages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from lopa_bench.clients.results import ClientRun, Failure, Load, Target

NAME = "inference-perf"
REPORTS = "reports"


def _fixed(tokens: int) -> dict[str, Any]:
    return {"type": "fixed", "min": tokens, "max": tokens, "mean": tokens, "std_dev": 0}


def config(target: Target, load: Load, work: Path, streaming: bool = True, compat: bool = False) -> dict:
    """`compat`: `server.ignore_eos: false` (inference-perf sends true by default)."""
    server: dict[str, Any] = {"type": "vllm", "model_name": target.model, "base_url": target.base_url}
    if compat:
        server["ignore_eos"] = False
    if target.api_key:
        server["api_key"] = target.api_key  # sent as a Bearer token
    return {
        "api": {"type": "completion", "streaming": streaming},
        "data": {"type": "random", "input_distribution": _fixed(load.prompt_tokens),
                 "output_distribution": _fixed(load.output_tokens)},
        "load": {"type": "constant", "stages": [{"rate": load.rate, "duration": load.seconds}]},
        "server": server,
        "tokenizer": {"pretrained_model_name_or_path": str(target.tokenizer)},
        "report": {"request_lifecycle": {"per_request": True}},
        "storage": {"local_storage": {"path": str(work / REPORTS)}},
    }


def prepare(venv: Path, target: Target, load: Load, work: Path, streaming: bool = True,
            compat: bool = False) -> list[str]:
    """Writes the config into `work`; returns the command that runs it."""
    path = work / "config.yml"
    path.write_text(yaml.safe_dump(config(target, load, work, streaming, compat), sort_keys=False))
    return [str(venv / "bin" / "inference-perf"), "--config_file", str(path)]


def parse(work: Path) -> ClientRun:
    reports = work / REPORTS
    summary_path = reports / "summary_lifecycle_metrics.json"
    run = ClientRun(NAME, report=str(reports))
    summary = json.loads(summary_path.read_text())
    successes, failures = summary.get("successes") or {}, summary.get("failures") or {}
    run.ok, run.failed = int(successes.get("count") or 0), int(failures.get("count") or 0)
    for label, group in (failures.get("by_label") or {}).items():
        messages = [str(m.get("message")) for m in group.get("messages") or [] if isinstance(m, dict)]
        run.failures[label] = Failure(int(group.get("count") or 0), messages[:5])
    if run.ok:
        run.prompt_tokens = _total(successes, "prompt_tokens")
        run.output_tokens = _total(successes, "output_tokens")
        latency = successes.get("latency") or {}
        run.ttft_s = _mean(latency, "time_to_first_token")
        run.tpot_s = _mean(latency, "time_per_output_token")
    run.headline = {"ttft_s_mean": run.ttft_s, "tpot_s_mean": run.tpot_s,
                    "itl_s_mean": _mean(successes.get("latency") or {}, "inter_token_latency"),
                    "prompt_tokens_total": run.prompt_tokens, "output_tokens_total": run.output_tokens,
                    "token_count_mismatches": successes.get("token_count_mismatches"),
                    "client_fallback_requests": successes.get("client_fallback_requests")}
    _per_request(run, reports / "per_request_lifecycle_metrics.json")
    return run


def _total(successes: dict, name: str) -> float | None:
    value = (successes.get(name) or {}).get("total")
    return float(value) if value is not None else None


def _mean(latency: dict, name: str) -> float | None:
    value = (latency.get(name) or {}).get("mean")
    return float(value) if value is not None else None


def _per_request(run: ClientRun, path: Path) -> None:
    """Token counts request by request: the client's re-tokenization, the usage it got, what it asked."""
    if not path.exists():
        return
    client = usage = asked = 0.0
    complete = True
    for entry in json.loads(path.read_text()):
        if entry.get("error"):
            continue
        metrics = ((entry.get("info") or {}).get("response_metrics")) or {}
        client += metrics.get("output_tokens") or 0
        got = (metrics.get("server_usage") or {}).get("completion_tokens")
        usage += got or 0
        try:
            wanted = json.loads(entry.get("request") or "{}").get("max_tokens")
        except json.JSONDecodeError:
            wanted = None
        if not isinstance(wanted, int) or got is None:
            complete = False
            continue
        asked += wanted
        run.not_exact += int(got != wanted)
    run.output_tokens_client, run.usage_output_tokens = client, usage
    run.asked_tokens = asked if complete else None
