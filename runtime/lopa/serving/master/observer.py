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
        m = self.metrics
        m.queue_depth.set(waiting)
        m.running.set(running)
        m.kv_slot_usage.set(running / slots if slots else 0.0)

    def admitted(self, queue_s: float) -> None:
        self.metrics.queue_seconds.observe(queue_s)

    def round(self, batch: int, granted: Sequence[int], wanted: Sequence[int]) -> None:
        self.metrics.batch_size.observe(batch)
        for g in granted:
            self.metrics.branches_granted.observe(g)
        self.metrics.branches_cut.inc(sum(w - g for w, g in zip(wanted, granted, strict=True) if w > g))

    def finished(self, request: Request, outcome: Outcome) -> None:
        latency = time.perf_counter() - request.arrived
        self.metrics.request_seconds.observe(latency)
        if isinstance(outcome, Completion):
            result = outcome.result
            if outcome.ttft_s > 0:  # 0: no round committed a token (nothing to time)
                self.metrics.ttft_seconds.observe(outcome.ttft_s)
                if result.tokens > 1:
                    self.metrics.tpot_seconds.observe((latency - outcome.ttft_s) / (result.tokens - 1))
            self.metrics.tokens.inc(result.tokens)
            self.metrics.forwards.inc(result.forwards)
            self.metrics.verified_tokens.inc(result.verified_tokens)
            if result.forwards:
                self.metrics.tpf.observe(result.tpf)
