"""The model-server protocol's metrics under vLLM's names, beside lopa's own.

The Gateway API Inference Extension's endpoint picker and the benchmark clients of the Kubernetes
inference world (inference-perf, guidellm) read a model server's load and latency by vLLM's metric
names, filtered by a `model_name` label. The master serves these on /metrics (its HTTP port and its
metrics port), each fed from the very measurement of its lopa twin (lopa.serving.master.observer).

| vLLM name                                   | lopa twin                                 |
| vllm:num_requests_waiting                   | lopa_queue_depth (one snapshot: Occupancy) |
| vllm:num_requests_running                   | lopa_requests_running                     |
| vllm:kv_cache_usage_perc (gpu_cache_...)    | lopa_kv_slot_usage                        |
| vllm:time_to_first_token_seconds            | lopa_time_to_first_token_seconds          |
| vllm:time_per_output_token_seconds          | lopa_time_per_output_token_seconds        |
| vllm:request_time_per_output_token_seconds  | lopa_time_per_output_token_seconds        |
| vllm:e2e_request_latency_seconds            | lopa_request_seconds (completed requests) |
| vllm:request_queue_time_seconds             | lopa_queue_seconds                        |
| vllm:prompt_tokens_total                    | (prompt tokens of completed requests)     |
| vllm:generation_tokens_total                | lopa_generated_tokens_total               |
| vllm:request_success_total{finished_reason} | lopa_requests_total{outcome="ok"}         |
| vllm:request_prompt_tokens, ..._generation_tokens | per completed request                |
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

LABEL = "model_name"
_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)
_PER_TOKEN = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


class Occupancy(Collector):
    """The queue and the KV sequences under both name sets, from one snapshot: a scrape never shows
    lopa's and vLLM's gauges apart, however busy the scheduler is."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._snapshot = (0, 0, 0.0)  # waiting, running, slot usage: replaced whole, read whole

    def set(self, waiting: int, running: int, slots: int) -> None:
        self._snapshot = (waiting, running, running / slots if slots else 0.0)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        waiting, running, usage = self._snapshot
        yield GaugeMetricFamily("lopa_queue_depth", "Requests waiting for a KV sequence", value=waiting)
        yield GaugeMetricFamily("lopa_requests_running", "Requests decoding (holding a KV sequence)",
                                value=running)
        yield GaugeMetricFamily("lopa_kv_slot_usage", "Fraction of the KV sequences (max_batch) in use",
                                value=usage)
        for name, text, value in (
            ("vllm:num_requests_waiting", "Requests waiting to be processed", waiting),
            ("vllm:num_requests_running", "Requests in model execution batches", running),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage", usage),
            # the name before vLLM 0.10, which older endpoint pickers read
            ("vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage", usage),
        ):
            family = GaugeMetricFamily(name, text, labels=[LABEL])
            family.add_metric([self.model_name], value)
            yield family


@dataclass
class VllmMetrics:
    ttft: Histogram
    tpot: Histogram
    request_tpot: Histogram
    e2e: Histogram
    queue: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter
    success: Counter  # label finished_reason: stop | length
    request_prompt_tokens: Histogram
    request_generation_tokens: Histogram
    model_name: str

    @classmethod
    def create(cls, registry: CollectorRegistry, model_name: str) -> VllmMetrics:
        def histogram(name: str, text: str, buckets: tuple) -> Histogram:
            return Histogram(name, text, [LABEL], buckets=buckets, registry=registry).labels(model_name)

        def counter(name: str, text: str) -> Counter:
            return Counter(name, text, [LABEL], registry=registry).labels(model_name)

        return cls(
            ttft=histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds", _LATENCY),
            tpot=histogram("vllm:time_per_output_token_seconds", "Time per output token in seconds",
                           _PER_TOKEN),
            request_tpot=histogram("vllm:request_time_per_output_token_seconds",
                                   "Time per output token of each request in seconds", _PER_TOKEN),
            e2e=histogram("vllm:e2e_request_latency_seconds", "End to end request latency in seconds",
                          _LATENCY),
            queue=histogram("vllm:request_queue_time_seconds", "Time spent waiting in the queue",
                            _LATENCY),
            prompt_tokens=counter("vllm:prompt_tokens", "Prefill tokens processed"),
            generation_tokens=counter("vllm:generation_tokens", "Generation tokens processed"),
            success=Counter("vllm:request_success", "Successfully processed requests",
                            [LABEL, "finished_reason"], registry=registry),
            request_prompt_tokens=histogram("vllm:request_prompt_tokens", "Prompt tokens per request",
                                            _TOKENS),
            request_generation_tokens=histogram("vllm:request_generation_tokens",
                                                "Generation tokens per request", _TOKENS),
            model_name=model_name,
        )
