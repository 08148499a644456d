"""Helpers of the operator acceptance tests: chart install, the operator process, waits.

The operator runs as a real subprocess (`python -m lopa_operator`) authenticated as the
chart's ServiceAccount, so a missing RBAC rule shows up as a Forbidden line in its log.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from kube.cluster import KubeCluster, free_ports

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "lopa-operator"
SAMPLES = REPO / "manifests" / "samples"
RELEASE = "lopa-operator"
RELEASE_NAMESPACE = "lopa-system"
SERVICE_ACCOUNT = "lopa-operator"  # the chart's fullname for this release name
RESYNC_SECONDS = 1.0  # short timer interval: status follows the cluster within a second or two
RETRY_REFUSED_SECONDS = 3.0  # a refused rendering (a missing CRD) is tried again within seconds
FORBIDDEN_MARKERS = ("Forbidden", "forbidden", " 403", "(403)", "Unauthorized", " 401")


def ensure_chart(kube: KubeCluster) -> None:
    """Installs the chart once per cluster (idempotent across test modules), watching every
    namespace: the shared operator serves each test's fresh namespace."""
    if kube.helm("status", RELEASE, "-n", RELEASE_NAMESPACE, check=False).returncode == 0:
        return
    kube.helm("install", RELEASE, str(CHART), "-n", RELEASE_NAMESPACE, "--create-namespace",
              "--set", "watchAllNamespaces=true")
    kube.kubectl("wait", "--for=condition=Established", "crd/lopadeployments.lopa.dev", "--timeout=60s")


def inference_extension(kube: KubeCluster) -> Path:
    """Installs the Gateway API Inference Extension's InferencePool CRD (fetched once per machine by
    tools/k8s-testenv/inference-crds.sh) and returns the directory of the fetched files."""
    script = REPO / "tools" / "k8s-testenv" / "inference-crds.sh"
    found = subprocess.run([str(script)], check=True, capture_output=True, text=True, timeout=600)
    directory = Path(found.stdout.strip().splitlines()[-1])
    for crd in sorted(directory.glob("*.yaml")):
        kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
    kube.kubectl("wait", "--for=condition=Established", f"crd/{INFERENCE_POOL_CRD}", "--timeout=60s")
    return directory


INFERENCE_POOL_CRD = "inferencepools.inference.networking.k8s.io"


def keda_crds(kube: KubeCluster) -> Path:
    """Installs KEDA's ScaledObject CRD (fetched once per machine by tools/k8s-testenv/keda-crds.sh)
    and returns the directory of the fetched files."""
    script = REPO / "tools" / "k8s-testenv" / "keda-crds.sh"
    found = subprocess.run([str(script)], check=True, capture_output=True, text=True, timeout=600)
    directory = Path(found.stdout.strip().splitlines()[-1])
    crd = directory / "keda.sh_scaledobjects.yaml"
    kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
    kube.kubectl("wait", "--for=condition=Established", "crd/scaledobjects.keda.sh", "--timeout=60s")
    return directory


class OperatorProcess:
    """`python -m lopa_operator` (all namespaces, `namespaces`, or the `scope` flags given) with a
    ServiceAccount's token."""

    def __init__(
        self,
        kube: KubeCluster,
        log_path: Path,
        *,
        service_account: str = SERVICE_ACCOUNT,
        sa_namespace: str = RELEASE_NAMESPACE,
        namespaces: list[str] | None = None,
        scope: list[str] | None = None,
    ) -> None:
        self.kube = kube
        self.log_path = log_path
        self.liveness_port, self.metrics_port = free_ports(2)
        self.kubeconfig = kube.serviceaccount_kubeconfig(sa_namespace, service_account, create=False)
        env = {
            **kube.env(self.kubeconfig),
            "LOPA_OPERATOR_RETRY_BACKOFF": "1",
            "PYTHONUNBUFFERED": "1",
        }
        if scope is None:
            scope = [f"--namespace={n}" for n in namespaces] if namespaces else ["--all-namespaces"]
        self.scope = scope
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lopa_operator",
                *scope,
                f"--liveness=http://127.0.0.1:{self.liveness_port}/healthz",
                f"--metrics-port={self.metrics_port}",
                f"--resync-seconds={RESYNC_SECONDS}",
                f"--retry-refused-seconds={RETRY_REFUSED_SECONDS}",
            ],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )

    def http_get(self, port: int, path: str) -> tuple[int, str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()

    def wait_started(self, timeout: float = 60.0) -> None:
        def live() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"operator exited with {self.process.returncode}:\n{self.log()}")
            return self.http_get(self.liveness_port, "/healthz")[0] == 200

        try:
            self.kube.wait_for(live, timeout=timeout, description="operator liveness endpoint")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n--- operator log ---\n{self.log()}") from None

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def forbidden_lines(self) -> list[str]:
        """Log lines of requests the API server denied, but for writes into a namespace being
        deleted (the NamespaceLifecycle admission's 403, which an earlier test's namespace still
        deleting in the background draws from an operator that watches every namespace)."""
        return [line for line in self.log().splitlines()
                if any(m in line for m in FORBIDDEN_MARKERS) and "because it is being terminated" not in line]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self._log.close()


@contextlib.contextmanager
def running_operator(kube: KubeCluster, log_path: Path) -> Iterator[OperatorProcess]:
    ensure_chart(kube)
    op = OperatorProcess(kube, log_path)
    try:
        op.wait_started()
        yield op
    finally:
        op.stop()


@contextlib.contextmanager
def process_node(kube: KubeCluster) -> Iterator[Any]:
    """A PodRunner (kube.pod_runner: pods run as local processes) with the kwok nodes cordoned, so
    that every pod scheduled meanwhile runs on it; skips the test where it cannot run."""
    import pytest

    from kube import netns
    from kube.nodes import DEFAULT_NODES
    from kube.pod_runner import PodRunner

    why = netns.available()
    if why:
        pytest.skip(f"running pods as processes {why}")
    ensure_chart(kube)  # its operator pod (unused: the tests run the operator) stays on a kwok node
    chart_pods = lambda: kube.get_json("pods", "-n", RELEASE_NAMESPACE)["items"]  # noqa: E731
    kube.wait_for(
        lambda: all(p["spec"].get("nodeName") for p in chart_pods()), timeout=30,
        description="the chart's pods scheduled",
    )
    nodes = [node.name for node in DEFAULT_NODES]
    kube.kubectl("cordon", *nodes)
    try:
        with PodRunner(kube) as pod_runner:
            yield pod_runner
    finally:
        kube.kubectl("uncordon", *nodes, check=False)


def load_sample(file: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((SAMPLES / file).read_text()) if d]


def lopa(kube: KubeCluster, namespace: str, name: str) -> dict[str, Any]:
    return kube.get_json("lopadeployment", name, "-n", namespace)


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c["type"] == kind:
            return c
    return {}


def pods(kube: KubeCluster, namespace: str, name: str, role: str = "worker") -> list[dict[str, Any]]:
    selector = f"app.kubernetes.io/instance={name},app.kubernetes.io/component={role}"
    items = kube.get_json("pods", "-n", namespace, "-l", selector)["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def wait_status(
    kube: KubeCluster,
    namespace: str,
    name: str,
    check: Callable[[dict[str, Any]], bool],
    timeout: float = 60.0,
    description: str = "status",
) -> dict[str, Any]:
    """Polls the LoPADeployment until `check(obj)`; the timeout message carries the last status."""
    last: dict[str, Any] = {}

    def probe() -> dict[str, Any] | None:
        nonlocal last
        last = lopa(kube, namespace, name)
        return last if check(last) else None

    try:
        return kube.wait_for(probe, timeout=timeout, interval=0.5, description=description)
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}; last status:\n{json.dumps(last.get('status'), indent=1)}") from None


def is_available(obj: dict[str, Any]) -> bool:
    st = obj.get("status") or {}
    return (
        st.get("phase") == "Available"
        and condition(obj, "Available").get("status") == "True"
        and st.get("observedGeneration") == obj["metadata"]["generation"]
    )


def ask_client_pod(
    kube: KubeCluster, runner: Any, ns: str, deployment: str, prompt: str, tag: str, attempts: int = 4
) -> dict[str, Any]:
    """One request (`prompt`) from a client pod to LoPADeployment `deployment` through its client
    Service's name, as a client in the cluster sends it; its JSON answer.

    UNAVAILABLE is retried a few times, as a gRPC client should: right after a group restart the
    master's readiness may still drop (its probe fails 3 times 5 s apart while the group re-forms,
    and the third failure can land once the new group already serves), taking the master out of
    the Service's endpoints for one probe period."""
    for attempt in range(attempts):
        phase, log = _client_pod(kube, runner, ns, deployment, prompt, f"client-{tag}-{attempt}")
        if phase == "Succeeded":
            line = next(line for line in reversed(log.splitlines()) if line.startswith("{"))
            return dict(json.loads(line))
        if "UNAVAILABLE" not in log or attempt == attempts - 1:
            break
        time.sleep(3)
    raise AssertionError(f"client pod failed:\n{log}\n{runner.report()}")


def _client_pod(
    kube: KubeCluster, runner: Any, ns: str, deployment: str, prompt: str, name: str
) -> tuple[str, str]:
    """Runs `lopa client generate` against status.endpoint in pod `name`: (its phase, its output)."""
    endpoint = lopa(kube, ns, deployment)["status"]["endpoint"]
    image = pods(kube, ns, deployment, "master")[0]["spec"]["containers"][0]["image"]
    command = ["lopa", "client", "generate", "--address", endpoint, "--prompt", prompt, "--json",
               "--timeout", "120"]
    runner.api.post(f"/api/v1/namespaces/{ns}/pods", {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "securityContext": {"runAsNonRoot": True, "runAsUser": 65532,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "client", "image": image, "command": command, "securityContext": {
                "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}],
        },
    })

    def finished() -> dict[str, Any] | None:
        pod = runner.api.get(f"/api/v1/namespaces/{ns}/pods/{name}")
        return pod if pod and pod["status"].get("phase") in ("Succeeded", "Failed") else None

    done = kube.wait_for(finished, timeout=180, description=f"client pod {name} to finish")
    return done["status"]["phase"], runner.log(ns, name)


def bind_model_volume(kube: KubeCluster, namespace: str, claim: str = "d2f-models") -> str:
    """A hostPath PV pre-bound to the sample's PVC (the test cluster has no provisioner)."""
    pv = f"models-{namespace}"
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": pv, "labels": {"lopa.dev/test": "true"}},
            "spec": {
                "capacity": {"storage": "40Gi"},
                "accessModes": ["ReadWriteMany", "ReadOnlyMany"],  # the sample claim is ReadWriteMany
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "hostPath": {"path": f"/tmp/{pv}"},
                "claimRef": {"namespace": namespace, "name": claim},
            },
        }
    )
    return pv


def delete_all(kube: KubeCluster, namespace: str, timeout: float = 60.0) -> None:
    """Deletes every LoPADeployment of `namespace` while the operator still runs (it owns the finalizer)."""
    kube.kubectl("delete", "lopadeployments", "--all", "-n", namespace, "--wait=false", check=False)
    kube.wait_for(
        lambda: not kube.get_json("lopadeployments", "-n", namespace)["items"],
        timeout=timeout,
        description=f"LoPADeployments of {namespace} gone",
    )


def elapsed(start: float) -> float:
    return time.monotonic() - start


def env_flag(name: str) -> bool:
    return os.environ.get(name) == "1"
