"""kopf wiring: settings, the edge-triggered handlers and the level-triggered resync timer."""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf

from . import metrics, names
from .kube import Kube
from .reconcile import forget, reconcile

# Seconds between resyncs of every LoPADeployment (status re-derived, lost workers noticed).
RESYNC_SECONDS = float(os.environ.get("LOPA_OPERATOR_RESYNC_SECONDS", "10"))
RETRY_BACKOFF = float(os.environ.get("LOPA_OPERATOR_RETRY_BACKOFF", "5"))

_kube: Kube | None = None


def kube() -> Kube:
    global _kube
    if _kube is None:
        _kube = Kube()
    return _kube


def _post(obj: dict[str, Any], kind: str, reason: str, message: str) -> None:
    kopf.event(obj, type=kind, reason=reason, message=message[:1000])


@kopf.on.startup()
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
    settings.watching.server_timeout = int(os.environ.get("LOPA_OPERATOR_WATCH_SERVER_TIMEOUT", "300"))
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
    settings.execution.max_workers = int(os.environ.get("LOPA_OPERATOR_WORKERS", "8"))
    metrics.serve(int(os.environ.get("LOPA_OPERATOR_METRICS_PORT", "9090")))


@kopf.on.create(names.GROUP, names.VERSION, names.PLURAL, backoff=RETRY_BACKOFF)
@kopf.on.update(names.GROUP, names.VERSION, names.PLURAL, field="spec", backoff=RETRY_BACKOFF)
@kopf.on.resume(names.GROUP, names.VERSION, names.PLURAL, backoff=RETRY_BACKOFF)
def on_change(
    name: str, namespace: str, logger: logging.Logger, reason: str, memo: kopf.Memo, **_: Any
) -> None:
    reconcile(kube(), namespace, name, str(reason), _post, logger, memo)


@kopf.timer(names.GROUP, names.VERSION, names.PLURAL, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS)
def resync(name: str, namespace: str, logger: logging.Logger, memo: kopf.Memo, **_: Any) -> None:
    reconcile(kube(), namespace, name, "timer", _post, logger, memo)


@kopf.on.delete(names.GROUP, names.VERSION, names.PLURAL, optional=True)
def on_delete(name: str, namespace: str, **_: Any) -> None:
    forget(namespace, name)  # the children go with their owner (garbage collector), the memo with kopf
