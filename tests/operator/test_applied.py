"""Which children a resync applies (lopa_operator.applied): changed renderings and drifted objects."""

from __future__ import annotations

from typing import Any

from lopa_operator.applied import apply_changed, live_versions


class Server:
    """Applies as the API server answers them: each changed object gets a new resourceVersion."""

    def __init__(self) -> None:
        self.version = 0
        self.applied: list[str] = []

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        self.applied.append(obj["metadata"]["name"])
        return {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.version)}}


def child(kind: str, name: str, replicas: int = 2) -> dict[str, Any]:
    return {"kind": kind, "metadata": {"name": name, "namespace": "ns"}, "spec": {"replicas": replicas}}


def test_only_a_changed_rendering_or_a_drifted_object_is_applied_again() -> None:
    server, memo = Server(), {}
    sets, service = child("StatefulSet", "d-0-worker"), child("Service", "d-workers")
    apply_changed(server, [sets, service], memo, {})  # type: ignore[arg-type]
    assert server.applied == ["d-0-worker", "d-workers"]
    version = memo["applied"][("StatefulSet", "d-0-worker")][1]

    # Read back unchanged: skipped. The Service is not read back (no live version): applied again.
    listed = {"StatefulSet": [{"metadata": {"name": "d-0-worker", "resourceVersion": version}}]}
    apply_changed(server, [sets, service], memo, live_versions(listed))  # type: ignore[arg-type]
    assert server.applied[2:] == ["d-workers"]

    # Changed on the server (scaled by hand): applied, then skipped at its new version.
    listed["StatefulSet"][0]["metadata"]["resourceVersion"] = "edited"
    apply_changed(server, [sets], memo, live_versions(listed))  # type: ignore[arg-type]
    assert server.applied[3:] == ["d-0-worker"]
    now = memo["applied"][("StatefulSet", "d-0-worker")][1]
    listed["StatefulSet"][0]["metadata"]["resourceVersion"] = now
    apply_changed(server, [sets], memo, live_versions(listed))  # type: ignore[arg-type]
    assert server.applied[4:] == []

    # A new rendering: applied whatever the server holds; a child no longer rendered drops out.
    apply_changed(server, [child("StatefulSet", "d-0-worker", replicas=3)], memo,  # type: ignore[arg-type]
                  live_versions(listed))
    assert server.applied[4:] == ["d-0-worker"] and set(memo["applied"]) == {("StatefulSet", "d-0-worker")}
