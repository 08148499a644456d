"""Fixtures for operator tests against a real Kubernetes control plane.

- `kube` (session): a started `kube.cluster.KubeCluster` (etcd, kube-apiserver,
  kube-controller-manager, kube-scheduler, kwok with 6 fake nodes: 2 GPU, 2 Ascend, 2 CPU).
- `kube_api` (session): a `kubernetes.client.ApiClient` for it, as cluster admin.
- `namespace` (function): a fresh namespace name (with its default ServiceAccount),
  deleted after the test.
- `operator` (module): the operator as a subprocess with the chart's ServiceAccount
  (lopa_op_helpers.running_operator), one per test module that asks for it.
- `ns` (function): `namespace` served by `operator`; after the test, the operator log's tail
  (shown when the test failed) and every LoPADeployment deleted.

The binaries come from tools/k8s-testenv/build.sh (Kueue's from kueue.sh, for the tests that
use it); when they are missing they are built right after collection (outside any test's
timeout), printing the build's progress.
"""

from __future__ import annotations

import contextlib
import re
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# `kube` lives in tests/kube; make `from kube.cluster import ...` work whatever the rootdir.
_TESTS_DIR = str(Path(__file__).resolve().parents[1])
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

from kube.cluster import KubeCluster, KubeClusterError, ensure_binaries  # noqa: E402
from kube.kueue import ensure_kueue  # noqa: E402

_build_error: str | None = None


def _uncaptured(config: pytest.Config) -> contextlib.AbstractContextManager[Any]:
    """Lets build/startup progress reach the terminal despite pytest's output capture."""
    capture = config.pluginmanager.getplugin("capturemanager")
    return capture.global_and_fixture_disabled() if capture else contextlib.nullcontext()


def pytest_collection_finish(session: pytest.Session) -> None:
    # A cold build takes far longer than a test's timeout, so it runs here, once,
    # before any test starts, and only when a collected test needs the cluster.
    global _build_error
    if session.config.option.collectonly:
        return
    if not any("kube" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    with _uncaptured(session.config):
        try:
            ensure_binaries()
            if any("kueue" in getattr(item, "fixturenames", ()) for item in session.items):
                ensure_kueue()  # Kueue's controller, built the same way (minutes when cold)
        except KubeClusterError as exc:
            _build_error = str(exc)


@pytest.fixture(scope="session")
def kube(pytestconfig: pytest.Config) -> Iterator[KubeCluster]:
    if _build_error:
        pytest.fail(f"building the test control plane failed:\n{_build_error}", pytrace=False)
    with _uncaptured(pytestconfig):
        bin_dir = ensure_binaries()
        cluster = KubeCluster.start(bin_dir)
        print(
            f"\n[kube] Kubernetes {cluster.version.get('gitVersion')} with {len(cluster.nodes)} fake nodes "
            f"up in {cluster.startup_seconds:.1f}s at {cluster.server} (work dir {cluster.work_dir})",
            file=sys.stderr,
        )
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def kube_api(kube: KubeCluster) -> Iterator[Any]:
    client = kube.api_client()
    try:
        yield client
    finally:
        client.close()


def _namespace_name(test_name: str) -> str:
    slug = re.sub(r"[^a-z0-9-]+", "-", test_name.lower()).strip("-")[:40].rstrip("-")
    return f"t-{slug or 'test'}-{secrets.token_hex(3)}"


@pytest.fixture
def namespace(kube: KubeCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    name = _namespace_name(request.node.name)
    kube.kubectl("create", "namespace", name)
    kube.kubectl("label", "namespace", name, "lopa.dev/test=true")
    # Pods are rejected until the controller-manager has made the default ServiceAccount.
    kube.wait_for(
        lambda: kube.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
        timeout=30,
        description=f"ServiceAccount {name}/default",
    )
    try:
        yield name
    finally:
        # No waiting: namespace finalization runs in the background of the next tests.
        kube.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


@pytest.fixture(scope="module")
def operator(kube: KubeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from lopa_op_helpers import running_operator

    with running_operator(kube, tmp_path_factory.mktemp("operator") / "operator.log") as op:
        yield op


@pytest.fixture
def ns(kube: KubeCluster, namespace: str, operator: Any) -> Iterator[str]:
    from lopa_op_helpers import delete_all

    yield namespace
    print("--- operator log (tail) ---\n" + "\n".join(operator.log().splitlines()[-60:]))
    delete_all(kube, namespace)
