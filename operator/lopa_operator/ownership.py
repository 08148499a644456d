"""Which API errors are the spec's fault, and the rule that a child never takes over a stranger."""

from __future__ import annotations

from typing import Any

from .kube import Kube, KubeError, path

# Bad Request / Unprocessable Entity: the rendered object is invalid. Forbidden: an admission rule
# refuses it (a ResourceQuota such as count/statefulsets.apps on a scale-up, a webhook, a policy) or the
# operator lacks a permission; neither heals by retrying soon, and its message is what the user needs.
_SPEC_ERRORS = (400, 403, 422)
# Server-side applies answered 500 that are yet the spec's fault: a value that does not decode (e.g.
# resources.limits.cpu: banana: "failed to convert new object ...: quantities must match ...") and a
# field the child's schema lacks, from a spec field the CRD leaves open (resources, affinity,
# tolerations: e.g. affinity.nodeAfinity: "failed to create typed patch object ...: field not
# declared in schema").
_SPEC_500S = ("unable to convert unstructured object", "failed to create typed patch object")


class ForeignObject(KubeError):
    """A child's name is taken by an object this LoPADeployment does not control (the user's own, or
    another LoPADeployment's): server-side apply with force would take it over, and the garbage
    collector would delete it with this CR."""

    def __init__(self, message: str) -> None:
        super().__init__(409, message)


class NotServed(KubeError):
    """What the spec asks of the cluster is not there (an API, a Kueue LocalQueue): the message says
    what and how to get it; retrying soon does not help."""

    def __init__(self, message: str) -> None:
        super().__init__(404, message)


def spec_error(error: KubeError) -> bool:
    if isinstance(error, ForeignObject | NotServed):
        return True
    spec_500 = error.status == 500 and any(marker in error.message for marker in _SPEC_500S)
    return error.status in _SPEC_ERRORS or spec_500


def refuse_foreign(kube: Kube, child: dict[str, Any], owner: dict[str, Any]) -> None:
    """ForeignObject when the child's name exists without this CR as its controller."""
    meta = child["metadata"]
    existing = kube.get(path(child["kind"], meta["namespace"], meta["name"]))
    if existing is None:
        return
    refs = (existing.get("metadata") or {}).get("ownerReferences") or []
    controller = next((r for r in refs if r.get("controller")), None)
    if controller is not None and controller.get("uid") == owner["metadata"]["uid"]:
        return
    holder = f"{controller['kind']} {controller['name']}" if controller else "no controller (made elsewhere)"
    raise ForeignObject(
        f"{child['kind']} {meta['namespace']}/{meta['name']} already exists and belongs to {holder}: "
        "not taken over (rename this LoPADeployment, or delete that object)"
    )
