"""Which children a resync applies: the ones whose rendering changed, or that changed on the server.

A server-side apply of an unchanged child is a no-op write that the API server still decodes,
merges and compares (a deployment of one group has 9 children), so the memo keeps, per child, the
digest of the rendering last applied and the resourceVersion that apply left. A child whose
rendering is the same and whose live resourceVersion, read this round anyway, is still that one has
not drifted: it is not applied. A child the round did not read (no live version) is applied every
resync.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from . import config, metrics
from .kube import Kube

ChildKey = tuple[str, str]  # (kind, name) in the owner's namespace
Versions = dict[ChildKey, str]  # child -> its resourceVersion on the server


def child_key(child: dict[str, Any]) -> ChildKey:
    return child["kind"], child["metadata"]["name"]


def live_versions(listed: dict[str, list[dict[str, Any]]]) -> Versions:
    """The resourceVersions of objects read this round, by kind (a list's items carry no kind)."""
    return {(kind, o["metadata"]["name"]): o["metadata"].get("resourceVersion", "")
            for kind, objs in listed.items() for o in objs}


def apply_changed(kube: Kube, children: list[dict[str, Any]], memo: MutableMapping[str, Any],
                  live: Versions) -> None:
    """Applies each child unless it is unchanged since this operator applied the same rendering."""
    before: dict[ChildKey, tuple[str, str]] = memo.get("applied") or {}
    after = {}
    for child in children:
        key, digest = child_key(child), config.digest(child)
        last = before.get(key)
        if last is None or last[0] != digest or not last[1] or live.get(key) != last[1]:
            result = kube.apply(child)
            last = (digest, (result.get("metadata") or {}).get("resourceVersion", ""))
            metrics.CHILD_APPLIES.labels(key[0], "applied").inc()
        else:
            metrics.CHILD_APPLIES.labels(key[0], "unchanged").inc()
        after[key] = last
    memo["applied"] = after  # children no longer rendered drop out
