"""The group Secret: what authenticates a group's master and workers to each other.

Each group has its own Secret `<name>-<i>-group`, mounted read-only at /etc/lopa/group in its
master and worker pods: `secret` (random, presented on every worker RPC and the rendezvous:
workers.secret_file) and, with spec.tls, `ca.crt`, `tls.crt`, `tls.key` (the link's mutual TLS:
workers.tls_*). It is made once and then kept as it is: every reconcile reads it back and applies
the same data. It is made again (new secret, new CA) when the group takes a new spec.restartTrigger
(the group rolls anyway), and the certificate alone when spec.tls is added or it nears its end.
Pod templates carry a hash of the data (`lopa.dev/group-secret-hash`), so a group whose Secret
was made again (deleted by hand, say) restarts on the new one: a group never runs two secrets.
"""

from __future__ import annotations

import base64
import datetime as dt
import secrets
from collections.abc import MutableMapping
from typing import Any

from . import config, names, pki

SECRET = "secret"
CA, CERT, KEY = "ca.crt", "tls.crt", "tls.key"
TLS_KEYS = (CA, CERT, KEY)

Data = dict[str, str]  # key -> text (the Secret's data, decoded)


def dns_names(name: str, namespace: str) -> list[str]:
    """What the workers' certificate names: every worker of every group of the deployment (the
    group's own CA is what keeps one group's members out of another)."""
    service = f"{names.worker_service(name)}.{namespace}.svc"
    return [f"*.{service}", f"*.{service}.{names.CLUSTER_DOMAIN}"]


def fresh(name: str, namespace: str, index: int, tls: bool) -> Data:
    data = {SECRET: secrets.token_hex(32)}  # 256 bits, printable: safe in any transport
    return with_tls(data, name, namespace, index) if tls else data


def with_tls(data: Data, name: str, namespace: str, index: int) -> Data:
    issued = pki.issue(f"{namespace}/{names.group(name, index)}", dns_names(name, namespace))
    return {**data, CA: issued.ca_pem, CERT: issued.cert_pem, KEY: issued.key_pem}


def _change(data: Data, trigger: str, name: str, namespace: str, spec: dict[str, Any],
            now: dt.datetime | None) -> str | None:
    """What the data needs at `spec`: "fresh", "strip" (TLS dropped), "tls" (a new certificate)
    or nothing."""
    if not data.get(SECRET) or trigger != (spec.get("restartTrigger") or ""):
        return "fresh"
    has_tls = any(k in data for k in TLS_KEYS)
    if not spec.get("tls"):
        return "strip" if has_tls else None
    complete = all(data.get(k) for k in TLS_KEYS)
    return None if complete and pki.still_good(data[CERT], dns_names(name, namespace), now) else "tls"


def wanted(
    existing: dict[str, Any] | None,
    name: str,
    namespace: str,
    index: int,
    spec: dict[str, Any],
    now: dt.datetime | None = None,
) -> Data:
    """The data group `index` runs with at `spec`: the existing Secret's as far as it fits."""
    data, trigger = read(existing)
    change = _change(data, trigger, name, namespace, spec, now)
    if change == "fresh":
        return fresh(name, namespace, index, bool(spec.get("tls")))
    if change == "strip":
        return {k: v for k, v in data.items() if k not in TLS_KEYS}
    return with_tls(data, name, namespace, index) if change == "tls" else data


def pending(
    memo: MutableMapping[str, Any], existing: dict[str, Any] | None, name: str, namespace: str, index: int,
    spec: dict[str, Any],
) -> Data:
    """wanted(), made once per (existing data, spec) while it waits to be applied: a rendering the
    API server refuses is then the same on the next resync (its refusal is remembered by digest)."""
    data, trigger = read(existing)
    cache = memo.setdefault("credentials", {})
    if _change(data, trigger, name, namespace, spec, None) is None:
        cache.pop(index, None)  # applied: a Secret deleted later is made anew, not from here
        return data
    key = (config.digest(data, trigger), spec.get("restartTrigger") or "", bool(spec.get("tls")))
    if cache.get(index, (None,))[0] != key:
        cache[index] = (key, wanted(existing, name, namespace, index, spec))
    return dict(cache[index][1])


def read(obj: dict[str, Any] | None) -> tuple[Data, str]:
    """(data, restart trigger it was made for) of a group Secret as the API server holds it."""
    if not obj:
        return {}, ""
    raw = obj.get("data") or {}
    data = {k: base64.b64decode(v).decode(errors="replace") for k, v in raw.items()}
    trigger = (obj.get("metadata", {}).get("annotations") or {}).get(names.TRIGGER_ANNOTATION, "")
    return data, trigger


def digest(data: Data) -> str:
    """The hash pod templates carry: stable while the data is (never a reroll by itself)."""
    return config.digest(sorted(data.items()))


def secret(name: str, namespace: str, index: int, data: Data, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": names.group_secret(name, index),
            "namespace": namespace,
            "labels": names.labels(name, index=index),
            "annotations": {names.TRIGGER_ANNOTATION: spec.get("restartTrigger") or ""},
        },
        "type": "Opaque",
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in sorted(data.items())},
    }
