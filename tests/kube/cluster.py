"""A real Kubernetes control plane for tests, run as plain processes on loopback.

`KubeCluster.start()` runs etcd, kube-apiserver, kube-controller-manager, kube-scheduler
and kwok (which plays the kubelets of fake nodes) in a temporary directory, registers
the fake nodes of `kube.nodes.DEFAULT_NODES` and waits until they are Ready. The
binaries come from `tools/k8s-testenv/build.sh` (see `find_bin_dir`/`ensure_binaries`).

Every component's log is kept in `<work_dir>/logs/<component>.log`; when startup fails
the tails of those logs are put into the raised `KubeClusterError`. Startup is bounded
by `start_timeout` and every child process dies with the Python process (atexit, plus
PR_SET_PDEATHSIG so even a SIGKILLed test run leaves no control plane behind).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lopa.serving.ports import free_ports  # one helper for every suite's loopback ports

from .binaries import (
    BUILD_SCRIPT,
    KWOK_STAGES,
    REPO_ROOT,
    REQUIRED_BINARIES,
    ensure_binaries,
    find_bin_dir,
    missing_binaries,
)
from .certs import ClusterPKI, kubeconfig_dict, make_pki, write_kubeconfig
from .components import (
    POD_CIDR,
    SERVICE_ACCOUNT_ISSUER,
    SERVICE_CIDR,
    SERVICE_IP,
    apiserver_args,
    controller_manager_args,
    etcd_args,
    kwok_args,
    scheduler_args,
)
from .errors import CommandError, KubeClusterError
from .nodes import DEFAULT_NODES, KWOK_ANNOTATION, KWOK_ANNOTATION_VALUE, FakeNode
from .processes import (
    OWNER_FILE,
    WORK_DIR_PREFIX,
    Component,
    check_alive,
    remove_stale_work_dirs,
    spawn,
    stop_components,
    tail,
)

# Names that have always been importable from `kube.cluster`.
__all__ = [
    "BUILD_SCRIPT",
    "DEFAULT_NODES",
    "KWOK_ANNOTATION",
    "KWOK_ANNOTATION_VALUE",
    "KWOK_STAGES",
    "OWNER_FILE",
    "POD_CIDR",
    "REPO_ROOT",
    "REQUIRED_BINARIES",
    "SERVICE_ACCOUNT_ISSUER",
    "SERVICE_CIDR",
    "SERVICE_IP",
    "WORK_DIR_PREFIX",
    "ClusterPKI",
    "CommandError",
    "FakeNode",
    "KubeCluster",
    "KubeClusterError",
    "ensure_binaries",
    "find_bin_dir",
    "free_ports",
    "kubeconfig_dict",
    "make_pki",
    "missing_binaries",
]


@dataclass
class KubeCluster:
    """A running control plane. Create it with `KubeCluster.start()`; end it with `stop()`.

    Attributes meant for tests: `bin_dir`, `work_dir`, `kubeconfig` (admin, system:masters),
    `server` (https URL), `ca_file`, `nodes` (the fake nodes registered), `version`
    (what /version reported), `startup_seconds`, `log_dir`.
    """

    bin_dir: Path
    work_dir: Path
    keep_work_dir: bool = False
    nodes: tuple[FakeNode, ...] = DEFAULT_NODES
    server: str = ""
    ports: dict[str, int] = field(default_factory=dict)
    version: dict[str, Any] = field(default_factory=dict)
    startup_seconds: float = 0.0
    _components: list[Component] = field(default_factory=list)
    _pki: ClusterPKI | None = None
    _stopped: bool = False

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def start(
        cls,
        bin_dir: Path | None = None,
        *,
        nodes: Sequence[FakeNode] = DEFAULT_NODES,
        start_timeout: float = 180.0,
        work_dir: Path | None = None,
        keep_work_dir: bool | None = None,
    ) -> KubeCluster:
        """Starts everything and returns once the API server is ready and every fake
        node is Ready; raises KubeClusterError (with log tails) within ~start_timeout.

        `keep_work_dir` (default: env LOPA_KUBE_KEEP=1) keeps certs, data and logs after stop().
        """
        bin_dir = Path(bin_dir) if bin_dir else find_bin_dir()
        missing = missing_binaries(bin_dir)
        if missing:
            raise KubeClusterError(
                f"missing {', '.join(missing)} in {bin_dir}; run tools/k8s-testenv/build.sh"
            )
        if keep_work_dir is None:
            keep_work_dir = os.environ.get("LOPA_KUBE_KEEP") == "1"
        began = time.monotonic()
        deadline = began + start_timeout
        for attempt in (1, 2):
            if work_dir is None:
                remove_stale_work_dirs()
                work = Path(tempfile.mkdtemp(prefix=WORK_DIR_PREFIX))
            else:
                work = Path(work_dir)
                work.mkdir(parents=True, exist_ok=True)
            (work / OWNER_FILE).write_text(str(os.getpid()))
            cluster = cls(bin_dir=bin_dir, work_dir=work, keep_work_dir=keep_work_dir, nodes=tuple(nodes))
            atexit.register(cluster.stop)
            try:
                cluster._start_all(deadline)
            except Exception as exc:
                report = cluster._failure_report(exc)
                cluster.stop()
                # The free ports are picked before the servers bind them, so another
                # process may take one in between: that (only) is worth one more try.
                if attempt == 1 and "address already in use" in report and time.monotonic() < deadline:
                    continue
                raise KubeClusterError(report) from exc
            except BaseException:  # KeyboardInterrupt, pytest-timeout, ...: still no leftovers
                cluster.stop()
                raise
            cluster.startup_seconds = time.monotonic() - began
            return cluster
        raise AssertionError("unreachable")

    def __enter__(self) -> KubeCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self, timeout: float = 15.0) -> None:
        """Stops every component (newest first) and removes the work dir. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        stop_components(self._components, timeout)
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        if self.keep_work_dir:
            with contextlib.suppress(OSError):
                (self.work_dir / "keep").touch()  # spares it from remove_stale_work_dirs
        else:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    @property
    def running(self) -> bool:
        return not self._stopped and all(c.process.poll() is None for c in self._components)

    # ------------------------------------------------------------------ paths

    @property
    def log_dir(self) -> Path:
        return self.work_dir / "logs"

    @property
    def kubeconfig(self) -> Path:
        """Admin kubeconfig (system:masters) for kubectl, helm and the Python client."""
        return self.work_dir / "kubeconfigs" / "admin.kubeconfig"

    @property
    def ca_file(self) -> Path:
        return self.work_dir / "pki" / "ca.crt"

    def log_path(self, component: str) -> Path:
        return self.log_dir / f"{component}.log"

    # ------------------------------------------------------------------ tools

    def env(self, kubeconfig: Path | None = None) -> dict[str, str]:
        """Environment for kubectl/helm/operator subprocesses talking to this cluster."""
        home = self.work_dir / "home"
        return {
            **os.environ,
            "KUBECONFIG": str(kubeconfig or self.kubeconfig),
            "PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            # helm keeps its repos/cache here instead of the developer's home.
            "HELM_CONFIG_HOME": str(home / "helm-config"),
            "HELM_CACHE_HOME": str(home / "helm-cache"),
            "HELM_DATA_HOME": str(home / "helm-data"),
        }

    def _run_tool(
        self,
        tool: str,
        args: Iterable[str],
        check: bool,
        input: str | None,
        timeout: float,
        kubeconfig: Path | None,
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.bin_dir / tool), *map(str, args)],
            env=self.env(kubeconfig), input=input, capture_output=True, text=True,
            timeout=timeout, check=False,
        )
        if check and result.returncode != 0:
            raise CommandError(result)
        return result

    def kubectl(
        self,
        *args: str,
        check: bool = True,
        input: str | None = None,
        timeout: float = 120.0,
        kubeconfig: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Runs kubectl as admin (or with `kubeconfig`); raises CommandError on failure if check."""
        return self._run_tool("kubectl", args, check, input, timeout, kubeconfig)

    def helm(
        self,
        *args: str,
        check: bool = True,
        input: str | None = None,
        timeout: float = 300.0,
        kubeconfig: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Runs helm against this cluster; raises CommandError on failure if check."""
        return self._run_tool("helm", args, check, input, timeout, kubeconfig)

    def apply(
        self, manifest: str | dict[str, Any] | list[dict[str, Any]], namespace: str | None = None
    ) -> None:
        """`kubectl apply -f -` of YAML text or of manifest dict(s)."""
        if not isinstance(manifest, str):
            docs = manifest if isinstance(manifest, list) else [manifest]
            manifest = yaml.safe_dump_all(docs)
        args = ["apply", "-f", "-"] + (["-n", namespace] if namespace else [])
        self.kubectl(*args, input=manifest)

    def api_client(self, kubeconfig: Path | None = None) -> Any:
        """A new `kubernetes.client.ApiClient` for this cluster (admin unless `kubeconfig`)."""
        from kubernetes import config  # imported lazily: only tests that use it need it

        return config.new_client_from_config(config_file=str(kubeconfig or self.kubeconfig))

    def serviceaccount_kubeconfig(
        self, namespace: str, name: str, duration: str = "24h", create: bool = True
    ) -> Path:
        """A kubeconfig that authenticates as ServiceAccount `namespace/name` with a bound
        token from the TokenRequest API (`kubectl create token`), so RBAC applies as it
        would to an in-cluster pod. Creates the ServiceAccount when `create` and it is missing.
        """
        if create:
            exists = self.kubectl("get", "serviceaccount", name, "-n", namespace, check=False)
            if exists.returncode != 0:
                self.kubectl("create", "serviceaccount", name, "-n", namespace)
        token = self.kubectl(
            "create", "token", name, "-n", namespace, f"--duration={duration}"
        ).stdout.strip()
        path = self.work_dir / "kubeconfigs" / f"sa-{namespace}-{name}.kubeconfig"
        config = kubeconfig_dict(
            self.server, self.ca_file, {"token": token}, name=f"sa-{namespace}-{name}", namespace=namespace
        )
        self._write_kubeconfig(path, config)
        return path

    def wait_for(
        self,
        condition: Callable[[], Any],
        timeout: float = 60.0,
        interval: float = 0.5,
        description: str = "condition",
    ) -> Any:
        """Polls `condition` until it returns a truthy value (returned); raises
        TimeoutError naming `description` (and the last exception, if any) after timeout."""
        deadline = time.monotonic() + timeout
        last_error: BaseException | None = None
        while True:
            try:
                value = condition()
                if value:
                    return value
            except Exception as exc:  # retried until the deadline
                last_error = exc
            if time.monotonic() >= deadline:
                detail = f" (last error: {last_error!r})" if last_error else ""
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {description}{detail}")
            time.sleep(interval)

    def get_json(self, *args: str, kubeconfig: Path | None = None) -> Any:
        """`kubectl get ARGS -o json`, parsed."""
        return json.loads(self.kubectl("get", *args, "-o", "json", kubeconfig=kubeconfig).stdout)

    def logs(self, component: str, lines: int = 80) -> str:
        """Last lines of a component's log (etcd, kube-apiserver, ..., kwok)."""
        return tail(self.log_path(component), lines)

    # ------------------------------------------------------------------ startup

    def _start_all(self, deadline: float) -> None:
        for sub in ("logs", "kubeconfigs", "etcd-data", "home", "kcm-certs", "scheduler-certs"):
            (self.work_dir / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        names = ("etcd-client", "etcd-peer", "apiserver", "controller-manager", "scheduler", "kwok")
        self.ports = dict(zip(names, free_ports(len(names)), strict=True))
        self.server = f"https://127.0.0.1:{self.ports['apiserver']}"
        self._pki = make_pki(
            self.work_dir / "pki",
            apiserver_ips=["127.0.0.1", SERVICE_IP],
            apiserver_names=[
                "localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ],
        )
        for client, pair in self._pki.clients.items():
            user = {"client-certificate": str(pair.cert), "client-key": str(pair.key)}
            path = self.work_dir / "kubeconfigs" / f"{client}.kubeconfig"
            self._write_kubeconfig(path, kubeconfig_dict(self.server, self.ca_file, user))

        self._start_etcd()
        self._wait(deadline, "etcd to be healthy", self._etcd_healthy)
        self._start_apiserver()
        self._wait(deadline, "kube-apiserver /readyz", self._apiserver_ready)
        self.version = json.loads(self._apiserver_get("/version"))
        self._start_controller_manager()
        self._start_scheduler()
        self._start_kwok()
        for component in ("controller-manager", "scheduler"):
            self._wait(
                deadline, f"kube-{component} /healthz", lambda c=component: self._component_healthy(c)
            )
        self._register_nodes()
        self._wait(deadline, "the fake nodes to be Ready", self._nodes_ready)
        # Pods in `default` need the default ServiceAccount (created by the controller-manager).
        self._wait(
            deadline, "the default ServiceAccount", lambda: self._serviceaccount_exists("default", "default")
        )

    def _wait(self, deadline: float, description: str, condition: Callable[[], bool]) -> None:
        """Polls `condition`, failing fast if a component exited or the deadline passed."""
        while True:
            check_alive(self._components, description)
            with contextlib.suppress(Exception):
                if condition():
                    return
            if time.monotonic() >= deadline:
                raise KubeClusterError(f"timed out waiting for {description}")
            time.sleep(0.25)

    def _spawn(self, name: str, binary: str, args: list[str]) -> None:
        component = spawn(name, self.bin_dir / binary, args, self.log_path(name), self.work_dir)
        self._components.append(component)

    def _start_etcd(self) -> None:
        self._spawn("etcd", "etcd", etcd_args(self.work_dir, self.ports))

    def _start_apiserver(self) -> None:
        assert self._pki is not None
        self._spawn("kube-apiserver", "kube-apiserver", apiserver_args(self.work_dir, self.ports, self._pki))

    def _start_controller_manager(self) -> None:
        assert self._pki is not None
        self._spawn(
            "kube-controller-manager", "kube-controller-manager",
            controller_manager_args(self.work_dir, self.ports, self._pki),
        )

    def _start_scheduler(self) -> None:
        self._spawn("kube-scheduler", "kube-scheduler", scheduler_args(self.work_dir, self.ports))

    def _start_kwok(self) -> None:
        self._spawn("kwok", "kwok", kwok_args(self.work_dir, self.bin_dir, self.ports))

    def _register_nodes(self) -> None:
        self.apply([node.manifest() for node in self.nodes])

    # ------------------------------------------------------------------ probes

    def _ssl_context(self) -> ssl.SSLContext:
        assert self._pki is not None
        context = ssl.create_default_context(cafile=str(self._pki.ca.cert))
        admin = self._pki.clients["admin"]
        context.load_cert_chain(str(admin.cert), str(admin.key))
        return context

    def _apiserver_get(self, path: str, timeout: float = 5.0) -> str:
        context = self._ssl_context()
        with urllib.request.urlopen(self.server + path, context=context, timeout=timeout) as reply:
            return reply.read().decode()

    def _etcd_healthy(self) -> bool:
        url = f"http://127.0.0.1:{self.ports['etcd-client']}/health"
        with urllib.request.urlopen(url, timeout=2) as reply:
            return bool(json.loads(reply.read()).get("health") == "true")

    def _apiserver_ready(self) -> bool:
        return self._apiserver_get("/readyz").strip() == "ok"

    def _component_healthy(self, component: str) -> bool:
        # The components serve /healthz with a self-signed certificate; the path is
        # always allowed without credentials, so no verification is needed for a probe.
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        url = f"https://127.0.0.1:{self.ports[component]}/healthz"
        try:
            with urllib.request.urlopen(url, context=context, timeout=2) as reply:
                return reply.read().decode().strip() == "ok"
        except urllib.error.HTTPError:
            return False

    def _nodes_ready(self) -> bool:
        body = json.loads(self._apiserver_get("/api/v1/nodes"))
        ready = {
            item["metadata"]["name"]
            for item in body.get("items", [])
            for condition in item.get("status", {}).get("conditions", [])
            if condition.get("type") == "Ready" and condition.get("status") == "True"
        }
        return all(node.name in ready for node in self.nodes)

    def _serviceaccount_exists(self, namespace: str, name: str) -> bool:
        try:
            self._apiserver_get(f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}")
        except urllib.error.HTTPError:
            return False
        return True

    def _failure_report(self, exc: BaseException) -> str:
        parts = [f"test Kubernetes cluster failed to start: {exc}", f"work dir: {self.work_dir}"]
        for component in self._components:
            code = component.process.poll()
            state = "running" if code is None else f"exited {code}"
            parts.append(f"----- {component.name} ({state}), last lines of {component.log_path} -----")
            parts.append(tail(component.log_path))
        if self._components and not self.keep_work_dir:
            # The work dir (and its logs) is removed by stop(); the tails above are the record.
            parts.append("(set LOPA_KUBE_KEEP=1 to keep the work dir and full logs)")
        return "\n".join(parts)

    @staticmethod
    def _write_kubeconfig(path: Path, config: dict[str, Any]) -> None:
        write_kubeconfig(path, config)
