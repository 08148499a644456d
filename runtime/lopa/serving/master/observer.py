"""The scheduler's hooks -> the master's Prometheus metrics."""

from __future__ import annotations

import time
from collections.abc import Sequence

from lopa.scheduling.request import Completion, Outcome, Request
from lopa.scheduling.scheduler import Observer
from lopa.serving.shared.metrics import MasterMetrics


class MasterObserver(Observer):
    def __init__(self, metrics: MasterMetrics) -> None:
        self.metrics = metrics

    def occupancy(self, waiting: int, running: int, slots: int) -> None:
        self.metrics.occupancy.set(waiting, running, slots)

    def admitted(self, queue_s: float) -> None:
        self.metrics.queue_seconds.observe(queue_s)
        self.metrics.vllm.queue.observe(queue_s)

    def round(self, batch: int, granted: Sequence[int], wanted: Sequence[int]) -> None:
        self.metrics.batch_size.observe(batch)
        for g in granted:
            self.metrics.branches_granted.observe(g)
        self.metrics.branches_cut.inc(sum(w - g for w, g in zip(wanted, granted, strict=True) if w > g))

    def finished(self, request: Request, outcome: Outcome) -> None:
        m, latency = self.metrics, time.perf_counter() - request.arrived
        m.request_seconds.observe(latency)
        if not isinstance(outcome, Completion):
            return
        result, vllm = outcome.result, m.vllm
        vllm.e2e.observe(latency)
        if outcome.ttft_s > 0:  # 0: no round committed a token (nothing to time)
            m.ttft_seconds.observe(outcome.ttft_s)
            vllm.ttft.observe(outcome.ttft_s)
            if result.tokens > 1:
                tpot = (latency - outcome.ttft_s) / (result.tokens - 1)
                for histogram in (m.tpot_seconds, vllm.tpot, vllm.request_tpot):
                    histogram.observe(tpot)
        m.tokens.inc(result.tokens)
        m.forwards.inc(result.forwards)
        m.verified_tokens.inc(result.verified_tokens)
        if result.forwards:
            m.tpf.observe(result.tpf)
        prompt = len(result.prompt_ids)
        vllm.prompt_tokens.inc(prompt)
        vllm.generation_tokens.inc(result.tokens)
        vllm.request_prompt_tokens.observe(prompt)
        vllm.request_generation_tokens.observe(result.tokens)
        reason = "length" if outcome.finish_reason == "length" else "stop"
        vllm.success.labels(vllm.model_name, reason).inc()
