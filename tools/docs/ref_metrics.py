"""The metrics reference: every Prometheus series each process exports, from the code's own registries.

The master's and the workers' registries are built as the processes build them (lopa.serving.shared
.metrics), the operator's are its module's metrics; names, types, labels and help texts are read back
from them, so a metric added in code shows up here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Metric
from prometheus_client.metrics import MetricWrapperBase

from tools.docs.markdown import cell

SAMPLE_LABELS = {"le", "quantile"}  # a histogram's or summary's own, not the metric's


def master_registry() -> CollectorRegistry:
    from lopa.serving.shared.metrics import MasterMetrics

    return MasterMetrics.create("lopa-bundled").registry


def worker_registry() -> CollectorRegistry:
    from lopa.serving.shared.metrics import WorkerMetrics

    metrics = WorkerMetrics.create(rank=0)
    metrics.watch_forwards(lambda: {"eager": 0, "graph": 0})  # as a worker registers them at start
    metrics.watch_captures(lambda: (0, 0.0))
    return metrics.registry


def operator_metrics() -> list[MetricWrapperBase]:
    from lopa_operator import metrics

    return [value for value in vars(metrics).values() if isinstance(value, MetricWrapperBase)]


def declared_labels(registry: CollectorRegistry) -> dict[str, tuple[str, ...]]:
    """{family name: label names} of the registry's labelled metrics: a labelled metric that has not
    been observed yet has no samples to read them from (prometheus_client keeps them on the metric)."""
    out: dict[str, tuple[str, ...]] = {}
    for collector in list(registry._collector_to_names):
        if isinstance(collector, MetricWrapperBase):
            for family in collector.describe():
                out[family.name] = tuple(collector._labelnames)
    return out


def exposed_name(family: Metric) -> str:
    return f"{family.name}_total" if family.type == "counter" else family.name


def rows(families: Iterable[Metric], declared: dict[str, tuple[str, ...]]) -> list[str]:
    out = ["| metric | type | labels | meaning |", "| --- | --- | --- | --- |"]
    for family in sorted(families, key=lambda f: f.name):
        labels = list(declared.get(family.name, ()))
        for sample in family.samples:
            labels += [name for name in sample.labels if name not in labels and name not in SAMPLE_LABELS]
        shown = ", ".join(f"`{name}`" for name in labels)
        out.append(f"| `{exposed_name(family)}` | {family.type} | {shown} | {cell(family.documentation)} |")
    return [*out, ""]


def registry_rows(registry: CollectorRegistry, keep: Any = lambda family: True) -> list[str]:
    return rows([f for f in registry.collect() if keep(f)], declared_labels(registry))


def render() -> str:
    master = master_registry()
    operator = CollectorRegistry()
    for metric in operator_metrics():
        operator.register(metric)
    return "\n".join([
        "# Metrics reference",
        "",
        "Every Prometheus series lopa exports, read from the registries the processes build. A histogram "
        "`NAME` is exposed as `NAME_bucket`, `NAME_sum` and `NAME_count`; counters and histograms also "
        "expose prometheus-client's `NAME_created` timestamps. [Monitoring](../guides/monitoring.md) says "
        "how to scrape them and what the timings measure.",
        "",
        "## Master",
        "",
        "On the master's metrics port (`master.metrics_port`, 9090 in a cluster; `lopa serve "
        "--metrics-port`) and on `/metrics` of its HTTP port (`master.http_port`).",
        "",
        "### lopa's own",
        "",
        *registry_rows(master, lambda family: not family.name.startswith("vllm:")),
        "### Under vLLM's names",
        "",
        "The model-server protocol that inference gateways and benchmark clients read, labelled "
        "`model_name` (the served model id), each fed from the same measurement as its lopa twin.",
        "",
        *registry_rows(master, lambda family: family.name.startswith("vllm:")),
        "## Worker",
        "",
        "On each worker's metrics port (`workers.metrics_port`, 9090 in a cluster).",
        "",
        *registry_rows(worker_registry()),
        "## Operator",
        "",
        "On the operator's metrics port (`lopa-operator --metrics-port`, the chart's `metrics.port`).",
        "",
        *registry_rows(operator),
    ])
