"""The InferencePool of the Gateway API Inference Extension (spec.inferencePool), when enabled.

The pool selects the deployment's masters (every group's) on the master's HTTP API port, where the
endpoint picker scrapes /metrics; spec.inferencePool.endpointPicker names the picker's Service.
Its CRD belongs to the extension and may be missing: then no pool is made, the deployment's
groups serve as before, and the InferencePool condition (False, CRDNotInstalled) and a Warning
event say what to install. A refused or missing pool is tried again every `--retry-refused-seconds`
(lopa_operator.settings), and at once when the rendering changes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, MutableMapping
from typing import Any

import kopf

from . import config, names
from .kube import RESOURCES, Kube, KubeError
from .ownership import refuse_foreign, spec_error
from .settings import current

KIND = "InferencePool"
API_VERSION = RESOURCES[KIND][0]
CRD = f"{RESOURCES[KIND][1]}.{API_VERSION.split('/')[0]}"
CONDITION = "InferencePool"

EventFn = Callable[[dict[str, Any], str, str, str], None]


def enabled(spec: dict[str, Any]) -> bool:
    return bool((spec.get("inferencePool") or {}).get("enabled"))


def render(name: str, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    picker = spec["inferencePool"]["endpointPicker"]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": names.inference_pool(name),
            "namespace": namespace,
            "labels": names.labels(name, names.ROLE_MASTER),
        },
        "spec": {
            "selector": {"matchLabels": names.labels(name, names.ROLE_MASTER)},
            "targetPorts": [{"number": names.HTTP_PORT}],
            "endpointPickerRef": {
                "name": picker["name"],
                "port": {"number": picker.get("port", 9002)},
                "failureMode": picker.get("failureMode", "FailClose"),
            },
        },
    }


def _condition(ok: bool, reason: str, message: str) -> dict[str, Any]:
    return {"type": CONDITION, "status": "True" if ok else "False", "reason": reason, "message": message}


def sync(
    kube: Kube, obj: dict[str, Any], spec: dict[str, Any], memo: MutableMapping[str, Any], post: EventFn
) -> dict[str, Any] | None:
    """Applies or removes the pool; the InferencePool condition to report (None when disabled)."""
    meta = obj["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    if not enabled(spec):
        if _reported(obj) is not None:  # it was enabled: the pool goes (gone already, or no CRD: 404)
            kube.delete(KIND, namespace, names.inference_pool(name))
        memo.pop("pool", None)
        return None
    pool = render(name, namespace, spec)
    kopf.append_owner_reference(pool, owner=obj)
    rendered = config.digest(pool)
    last = memo.get("pool")  # (rendering, when, condition) of the last try
    failed = bool(last) and last[2]["status"] == "False"
    if failed and last[0] == rendered and time.monotonic() - last[1] < current().retry_refused_s:
        return last[2]  # a missing CRD or a refusal does not heal at once: no call every resync
    new = not last or last[0] != rendered or failed
    try:
        if new:  # a name taken by a stranger is checked once per rendering, as for every child
            refuse_foreign(kube, pool, obj)
        kube.apply(pool)  # every resync, like the other children: repairs drift
        picker = pool["spec"]["endpointPickerRef"]["name"]
        condition = _condition(True, "Applied", f"{KIND} {name} selects the masters on port "
                               f"{names.HTTP_PORT}; endpoint picker Service {picker}")
    except KubeError as error:
        if error.status == 404:
            condition = _condition(False, "CRDNotInstalled", (
                f"spec.inferencePool: the {KIND} CRD ({CRD}, {API_VERSION}) is not installed: install the "
                "Gateway API Inference Extension's CRDs, or set spec.inferencePool.enabled to false"))
        elif spec_error(error):
            condition = _condition(False, "ApplyFailed", f"spec.inferencePool: {error.message}"[:1000])
        else:
            raise
        if _reported(obj) != (condition["status"], condition["message"]):
            post(obj, "Warning", "InferencePoolUnavailable", condition["message"])
    memo["pool"] = (rendered, time.monotonic(), condition)
    return condition


def _reported(obj: dict[str, Any]) -> tuple[str, str] | None:
    """(status, message) of the InferencePool condition the object's status last carried."""
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == CONDITION:
            return c.get("status"), c.get("message")
    return None
