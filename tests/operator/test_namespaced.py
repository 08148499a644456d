"""A namespaced install (chart value watchNamespaces): Roles only, and the operator still works."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from lopa_op_helpers import (
    CHART,
    SAMPLES,
    OperatorProcess,
    delete_all,
    ensure_chart,
    is_available,
    wait_status,
)

from kube.cluster import KubeCluster

RELEASE = "lopa-team"
SERVICE_ACCOUNT = "lopa-team-lopa-operator"  # the chart's fullname for this release


@pytest.fixture(scope="module")
def team(
    kube: KubeCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, OperatorProcess]]:
    ensure_chart(kube)  # the CRD comes with the cluster-wide release
    namespace = f"t-team-{secrets.token_hex(3)}"
    system = f"{namespace}-system"
    kube.kubectl("create", "namespace", namespace)
    installed = kube.helm(
        "install",
        RELEASE,
        str(CHART),
        "-n",
        system,
        "--create-namespace",
        "--set",
        f"watchNamespaces={{{namespace}}}",
        "--skip-crds",
    )
    # The install notes point the sample at a watched namespace, not the caller's current one.
    assert f"samples/cpu.yaml -n {namespace}\n" in installed.stdout, installed.stdout
    log: Path = tmp_path_factory.mktemp("operator-ns") / "operator.log"
    op = OperatorProcess(
        kube, log, service_account=SERVICE_ACCOUNT, sa_namespace=system, namespaces=[namespace]
    )
    try:
        op.wait_started()
        yield namespace, op
        delete_all(kube, namespace)
    finally:
        op.stop()
        kube.helm("uninstall", RELEASE, "-n", system, check=False)
        kube.kubectl("delete", "namespace", namespace, system, "--wait=false", check=False)


def test_namespaced_rbac_has_no_cluster_rights(kube: KubeCluster, team: tuple[str, OperatorProcess]) -> None:
    namespace, _ = team
    user = f"system:serviceaccount:{namespace}-system:{SERVICE_ACCOUNT}"
    can = kube.kubectl(
        "auth", "can-i", "patch", "statefulsets.apps", "-n", namespace, f"--as={user}", check=False
    )
    assert can.stdout.strip() == "yes"
    cannot = kube.kubectl("auth", "can-i", "list", "pods", "-n", "default", f"--as={user}", check=False)
    assert cannot.stdout.strip() == "no"


def test_namespaced_operator_serves_its_namespace(
    kube: KubeCluster, team: tuple[str, OperatorProcess]
) -> None:
    namespace, op = team
    kube.kubectl("apply", "-n", namespace, "-f", str(SAMPLES / "cpu.yaml"))
    wait_status(kube, namespace, "lopa-cpu", is_available, timeout=90, description="CPU sample Available")
    assert not op.forbidden_lines(), "\n".join(op.forbidden_lines()[:20])
