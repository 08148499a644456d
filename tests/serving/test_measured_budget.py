"""A group runs the branch budget its workers measured at start (an accelerator's default): a real
worker and master over gRPC, the worker's measurement standing in for a GPU's (CI has none;
lopa.scheduling.calibration's own measurement is tested in tests/runtime)."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import pytest
import transformers

import lopa.serving.worker.service as worker_service
from lopa.serving.master.server import serve_master
from lopa.serving.shared.config import load_config

from .conftest import write_config


def test_the_master_runs_the_budget_its_worker_measured(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(worker_service, "measured_tokens", lambda window, device: 1024)
    warmed: list[int | None] = []
    warm_graphs = worker_service.warm_graphs

    def recording(window: object, params: object, budget: int | None) -> tuple[int, float]:
        warmed.append(budget)
        return warm_graphs(window, params, budget)

    monkeypatch.setattr(worker_service, "warm_graphs", recording)
    # Master and worker load the tokenizer on two threads of this process (in production they are
    # two processes): resolve transformers' lazily imported class first, which is not thread-safe.
    assert transformers.AutoTokenizer is not None
    config = load_config(write_config(tmp_path, checkpoint, 1))
    stop = threading.Event()
    worker = threading.Thread(target=worker_service.serve_worker, args=(config, 0, stop), daemon=True)
    worker.start()

    async def master_until_budget() -> None:
        task = asyncio.create_task(serve_master(config))
        try:
            for _ in range(600):  # the worker loads, joins; the master attaches: seconds
                if "branch budget: 1024 tokens per forward per worker" in caplog.text:
                    return
                await asyncio.sleep(0.1)
        finally:
            task.cancel()

    try:
        with caplog.at_level(logging.INFO):
            asyncio.run(master_until_budget())
    finally:
        stop.set()
        worker.join(10)
    assert "branch budget: 1024 tokens per forward per worker (measured by the workers at start: 1024" \
        in caplog.text
    # The graph warm-up ran with that budget before the worker joined (a CPU has no graphs: it says so).
    assert warmed == [1024]
    text = caplog.text
    assert text.index("no CUDA graphs on cpu: no graph buckets to capture before serving") < text.index(
        "rank 0 ready")
