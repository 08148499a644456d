"""Namespaced installs: with watchNamespaces, Roles only, and the operator still works; with the
chart's defaults, the operator watches and may touch its own namespace only."""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from lopa_op_helpers import (
    CHART,
    RESYNC_SECONDS,
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


DEFAULT_RELEASE = "lopa-own"
DEFAULT_ACCOUNT = "lopa-own-lopa-operator"  # the chart's fullname for this release


@pytest.fixture(scope="module")
def default_install(
    kube: KubeCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str, OperatorProcess]]:
    """The chart installed with its default values into a namespace of its own, and the operator
    run with the watch flags of the Deployment the chart made and its ServiceAccount's token.
    Yields (the release's namespace, another namespace, the operator)."""
    ensure_chart(kube)  # the CRD comes with the cluster-wide release
    home = f"t-own-{secrets.token_hex(3)}"
    elsewhere = f"{home}-elsewhere"
    kube.kubectl("create", "namespace", elsewhere)
    kube.helm("install", DEFAULT_RELEASE, str(CHART), "-n", home, "--create-namespace", "--skip-crds")
    deployment = kube.get_json("deployment", DEFAULT_RELEASE + "-lopa-operator", "-n", home)
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    scope = [a for a in args if a.startswith(("--namespace", "--all-namespaces"))]
    log: Path = tmp_path_factory.mktemp("operator-own") / "operator.log"
    op = OperatorProcess(kube, log, service_account=DEFAULT_ACCOUNT, sa_namespace=home, scope=scope)
    try:
        op.wait_started()
        yield home, elsewhere, op
        delete_all(kube, home)
    finally:
        op.stop()
        kube.kubectl("delete", "lopadeployments", "--all", "-n", elsewhere, "--wait=false", check=False)
        kube.helm("uninstall", DEFAULT_RELEASE, "-n", home, check=False)
        kube.kubectl("delete", "namespace", home, elsewhere, "--wait=false", check=False)


def test_the_default_install_watches_its_own_namespace_only(
    kube: KubeCluster, default_install: tuple[str, str, OperatorProcess]
) -> None:
    home, _, op = default_install
    assert op.scope == [f"--namespace={home}"]  # the chart's Deployment's flags
    assert re.search(rf"watching {home}$", op.log(), re.MULTILINE), op.log()


def test_the_default_install_cannot_read_a_secret_elsewhere(
    kube: KubeCluster, default_install: tuple[str, str, OperatorProcess]
) -> None:
    """With the operator's own token (a bound ServiceAccount token, as in its pod): a Secret of its
    namespace is readable, one of another namespace is Forbidden, and no cluster-wide binding names
    the ServiceAccount."""
    home, elsewhere, op = default_install
    for where in (home, elsewhere):
        kube.kubectl("create", "secret", "generic", "private", "--from-literal=key=value", "-n", where)
    own = kube.kubectl("get", "secret", "private", "-n", home, "-o", "name", kubeconfig=op.kubeconfig)
    assert own.stdout.strip() == "secret/private"
    other = kube.kubectl("get", "secret", "private", "-n", elsewhere, kubeconfig=op.kubeconfig, check=False)
    assert other.returncode != 0 and "Forbidden" in other.stderr, other.stderr
    listed = kube.kubectl("get", "secrets", "-A", kubeconfig=op.kubeconfig, check=False)
    assert listed.returncode != 0 and "Forbidden" in listed.stderr, listed.stderr
    # The API server's own answer for the account (a SubjectAccessReview, by impersonation).
    user = f"system:serviceaccount:{home}:{DEFAULT_ACCOUNT}"
    for verb in ("get", "patch", "delete", "create"):
        for resource in ("secrets", "statefulsets.apps", "pods"):
            said = kube.kubectl("auth", "can-i", verb, resource, "-n", elsewhere, f"--as={user}", check=False)
            assert said.stdout.strip() == "no", (verb, resource, said.stdout)
    subjects = [(s.get("kind"), s.get("namespace"), s.get("name"))
                for b in kube.get_json("clusterrolebindings")["items"] for s in b.get("subjects") or []]
    assert ("ServiceAccount", home, DEFAULT_ACCOUNT) not in subjects


def test_a_lopadeployment_in_another_namespace_is_left_alone(
    kube: KubeCluster, default_install: tuple[str, str, OperatorProcess]
) -> None:
    home, elsewhere, op = default_install
    kube.kubectl("apply", "-n", elsewhere, "-f", str(SAMPLES / "cpu.yaml"))
    kube.kubectl("apply", "-n", home, "-f", str(SAMPLES / "cpu.yaml"))
    wait_status(kube, home, "lopa-cpu", is_available, timeout=90, description="CPU sample Available")
    time.sleep(5 * RESYNC_SECONDS)  # several resyncs of the watched one
    ignored = kube.get_json("lopadeployment", "lopa-cpu", "-n", elsewhere)
    assert not ignored["metadata"].get("finalizers") and not ignored.get("status"), ignored
    assert not [a for a in ignored["metadata"].get("annotations") or {} if a.startswith("lopa.dev/")]
    children = kube.get_json("statefulsets,deployments,configmaps,secrets,services,networkpolicies",
                             "-n", elsewhere, "-l", "app.kubernetes.io/instance=lopa-cpu")["items"]
    assert children == []
    assert not op.forbidden_lines(), "\n".join(op.forbidden_lines()[:20])
