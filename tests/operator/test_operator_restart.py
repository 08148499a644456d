"""The operator keeps no state outside the cluster: a new process resumes from status alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lopa_op_helpers import (
    SAMPLES,
    OperatorProcess,
    delete_all,
    ensure_chart,
    is_available,
    pods,
    wait_status,
)

from kube.cluster import KubeCluster


def test_restarted_operator_resumes_and_notices_a_worker_lost_while_down(
    kube: KubeCluster, namespace: str, tmp_path: Path
) -> None:
    ensure_chart(kube)
    first = OperatorProcess(kube, tmp_path / "first.log")
    try:
        first.wait_started()
        kube.kubectl("apply", "-n", namespace, "-f", str(SAMPLES / "cpu.yaml"))
        wait_status(kube, namespace, "lopa-cpu", is_available, timeout=90, description="CPU sample Available")
    finally:
        first.stop()
    before = {p["metadata"]["uid"] for p in pods(kube, namespace, "lopa-cpu")}

    # While no operator runs, a worker disappears and the StatefulSet replaces it.
    kube.kubectl("delete", "pod", "lopa-cpu-0-worker-1", "-n", namespace)
    kube.wait_for(
        lambda: len(pods(kube, namespace, "lopa-cpu")) == 2, timeout=30, description="replacement pod"
    )

    second = OperatorProcess(kube, tmp_path / "second.log")
    try:
        second.wait_started()

        def recovered(o: dict[str, Any]) -> bool:
            now = {p["metadata"]["uid"] for p in pods(kube, namespace, "lopa-cpu")}
            return (
                o["status"].get("groupRestarts") == 1
                and is_available(o)
                and len(now) == 2
                and not now & before
            )

        wait_status(
            kube, namespace, "lopa-cpu", recovered, timeout=60, description="group recreated after resume"
        )
        assert not second.forbidden_lines()
        delete_all(kube, namespace)
    finally:
        second.stop()
