"""What the clients and the gateway read from `/metrics` on the API port, under vLLM's names.

inference-perf (server `type: vllm`) does not scrape: it asks a Prometheus server (`metrics.prometheus.url`)
PromQL over the run's window (`rate(<name>_sum[..])`, `histogram_quantile(.., <name>_bucket)`,
`increase(<name>_total[..])`, `avg_over_time(<gauge>[..])`), every selector filtered by
`model_name='<server.model_name>'`. The Gateway API Inference Extension's endpoint picker scrapes
`/metrics` on the pool's target port (the API port) itself and reads three gauges. guidellm reads no
server metrics. This module reports which of those series the API port serves, with that label.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# (name, kind, who reads it, required). Counters may be exposed as <name>_total (inference-perf
# queries both). Required: the endpoint picker's gauges, inference-perf's main summary (tokens,
# requests, latency, queue, TPOT) and TTFT; the others fill optional rows of its report (0 if absent).
READ: tuple[tuple[str, str, str, bool], ...] = (
    ("vllm:num_requests_waiting", "gauge", "endpoint picker, inference-perf", True),
    ("vllm:num_requests_running", "gauge", "endpoint picker, inference-perf", True),
    ("vllm:kv_cache_usage_perc", "gauge", "endpoint picker, inference-perf", True),
    ("vllm:prompt_tokens", "counter", "inference-perf", True),
    ("vllm:generation_tokens", "counter", "inference-perf", True),
    ("vllm:request_success", "counter", "inference-perf", True),
    ("vllm:e2e_request_latency_seconds", "histogram", "inference-perf", True),
    ("vllm:time_to_first_token_seconds", "histogram", "inference-perf", True),
    ("vllm:request_time_per_output_token_seconds", "histogram", "inference-perf (its TPOT)", True),
    ("vllm:inter_token_latency_seconds", "histogram", "inference-perf", False),
    ("vllm:request_queue_time_seconds", "histogram", "inference-perf", False),
    ("vllm:request_prompt_tokens", "histogram", "inference-perf", False),
    ("vllm:request_generation_tokens", "histogram", "inference-perf", False),
)
SUFFIXES = {"gauge": ("",), "counter": ("_total", ""), "histogram": ("_bucket", "_sum", "_count")}


@dataclass(frozen=True)
class SeriesCheck:
    name: str
    kind: str
    readers: str
    present: bool  # a sample of the name (any suffix of its kind) is served
    labelled: bool  # one carries model_name="<the served model>"
    required: bool


@dataclass(frozen=True)
class MetricsAnswer:
    url: str
    status: int | None  # None: nothing answered
    series: tuple[SeriesCheck, ...]



def check(base_url: str, model: str) -> MetricsAnswer:
    url = f"{base_url}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            status, text = reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return MetricsAnswer(url, error.code, _checks({}, model))
    except OSError:
        return MetricsAnswer(url, None, _checks({}, model))
    samples: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(dict(sample.labels))
    return MetricsAnswer(url, status, _checks(samples, model))


def _checks(samples: dict[str, list[dict[str, str]]], model: str) -> tuple[SeriesCheck, ...]:
    out = []
    for name, kind, readers, required in READ:
        labels = [lab for suffix in SUFFIXES[kind] for lab in samples.get(name + suffix, [])]
        out.append(SeriesCheck(name, kind, readers, bool(labels),
                               any(lab.get("model_name") == model for lab in labels), required))
    return tuple(out)
