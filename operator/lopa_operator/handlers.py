"""kopf wiring: kopf's settings, the edge-triggered handlers and the level-triggered resync timer,
registered with the operator's settings (lopa_operator.settings) by register()."""

from __future__ import annotations

import logging
from typing import Any

import kopf

from . import metrics, names
from .kube import Kube
from .reconcile import forget, reconcile
from .settings import Settings, current

_kube: Kube | None = None


def kube() -> Kube:
    global _kube
    if _kube is None:
        _kube = Kube()
    return _kube


def _post(obj: dict[str, Any], kind: str, reason: str, message: str) -> None:
    kopf.event(obj, type=kind, reason=reason, message=message[:1000])


def register(chosen: Settings) -> None:
    """Register the handlers with kopf, their intervals and backoff from `chosen`."""
    backoff, every = chosen.retry_backoff_s, chosen.resync_s
    kopf.on.startup()(configure)
    change = on_change
    for register_on in (
        kopf.on.create(names.GROUP, names.VERSION, names.PLURAL, backoff=backoff),
        kopf.on.update(names.GROUP, names.VERSION, names.PLURAL, field="spec", backoff=backoff),
        kopf.on.resume(names.GROUP, names.VERSION, names.PLURAL, backoff=backoff),
    ):
        change = register_on(change)
    kopf.timer(names.GROUP, names.VERSION, names.PLURAL, interval=every, initial_delay=every)(resync)
    kopf.on.delete(names.GROUP, names.VERSION, names.PLURAL, optional=True)(on_delete)


def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    prefix = names.GROUP
    settings.persistence.finalizer = f"{prefix}/finalizer"
    # Keep kopf's bookkeeping in annotations: status has a schema and one writer (status.py).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=prefix)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=prefix, key="last-handled-configuration"
    )
    # Stalled watches are a known kopf problem: bound every watch request.
    # (whole seconds: the API server rejects a fractional timeoutSeconds)
    chosen = current()
    settings.watching.server_timeout = chosen.watch_server_timeout_s
    settings.watching.client_timeout = settings.watching.server_timeout + 30
    settings.watching.connect_timeout = 30
    # A deletion that lands mid-resync waits for the timer thread; re-check soon, not kopf's 60 s,
    # so the finalizer goes (and the children with it) within seconds.
    settings.background.cancellation_polling = 2
    settings.background.instant_exit_timeout = 0.2
    # The CRD is installed with the chart: no need to watch CRDs or namespaces (and no RBAC for it).
    settings.scanning.disabled = True
    # kopf would post each handler's success as a Kubernetes event (every resync): only the
    # operator's own kopf.event() calls and kopf's warnings/errors become events.
    settings.posting.level = logging.WARNING
    settings.execution.max_workers = chosen.workers
    metrics.serve(chosen.metrics_port)


def on_change(
    name: str, namespace: str, logger: logging.Logger, reason: str, memo: kopf.Memo, **_: Any
) -> None:
    reconcile(kube(), namespace, name, str(reason), _post, logger, memo)


def resync(name: str, namespace: str, logger: logging.Logger, memo: kopf.Memo, **_: Any) -> None:
    reconcile(kube(), namespace, name, "timer", _post, logger, memo)


def on_delete(name: str, namespace: str, **_: Any) -> None:
    forget(namespace, name)  # the children go with their owner (garbage collector), the memo with kopf
