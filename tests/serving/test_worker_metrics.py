"""A worker's Prometheus registry (lopa.serving.shared.metrics.WorkerMetrics)."""

from __future__ import annotations

from prometheus_client import generate_latest

from lopa.serving.shared.metrics import WorkerMetrics


def test_worker_metrics_export_forwards_by_path() -> None:
    metrics = WorkerMetrics.create(0)
    counts = {"graph": 3, "eager": 5}
    metrics.watch_forwards(lambda: counts)
    counts["eager"] += 1  # read at scrape time
    text = generate_latest(metrics.registry).decode()
    assert 'lopa_worker_forwards_total{path="graph"} 3.0' in text
    assert 'lopa_worker_forwards_total{path="eager"} 6.0' in text


def test_worker_metrics_export_graph_captures() -> None:
    metrics = WorkerMetrics.create(0)
    stats = [(0, 0.0)]
    metrics.watch_captures(lambda: stats[0])
    stats[0] = (7, 1.25)  # read at scrape time
    text = generate_latest(metrics.registry).decode()
    assert "lopa_worker_graph_captures_total 7.0" in text
    assert "lopa_worker_graph_capture_seconds_total 1.25" in text
