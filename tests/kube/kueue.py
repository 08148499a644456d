"""Kueue beside the test control plane: its controller (built by tools/k8s-testenv/kueue.sh from
the Go module proxy) as a process on loopback, its CRDs, and its admission webhooks.

`Kueue(kube).start()` installs the kueue.x-k8s.io CRDs, starts `kueue` with a configuration of its
own (no leader election, no internal certificate management, the pod and StatefulSet integrations,
the visibility server off) serving its webhooks on a free loopback port with a certificate of the
cluster's CA, then registers the webhooks Kueue's manifests declare with their service reference
replaced by that URL. The pod and StatefulSet webhooks are limited to namespaces labelled
`NAMESPACE_LABEL`, so the other tests' pods never wait on Kueue. `stop()` removes the webhook
configurations first, then the process; the CRDs stay (harmless without the controller).

Without internal certificate management Kueue reads its metrics certificate from the fixed path
/etc/kueue/metrics/certs: it runs in a mount namespace of its own where an overlay over /etc holds
that directory (the host's /etc is never written), which needs root, `unshare` and overlayfs
(`unavailable()` says what is missing).
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from lopa.serving.ports import free_ports

from .binaries import REPO_ROOT
from .certs import KeyPair, serving_cert
from .cluster import KubeCluster
from .errors import KubeClusterError
from .processes import Component, spawn, stop_components, tail

SCRIPT = REPO_ROOT / "tools" / "k8s-testenv" / "kueue.sh"
NAMESPACE_LABEL = "lopa.dev/kueue"
# The webhooks of the kinds the tests use: pods (gate, group validation) and Kueue's own objects.
WEBHOOKS = ("mpod.kb.io", "vpod.kb.io", "mstatefulset.kb.io", "vstatefulset.kb.io", "mworkload.kb.io",
            "vworkload.kb.io", "mclusterqueue.kb.io", "vclusterqueue.kb.io", "mresourceflavor.kb.io",
            "vresourceflavor.kb.io", "vcohort.kb.io")
# Webhooks on core kinds: only for the namespaces Kueue manages here.
SCOPED = ("mpod.kb.io", "vpod.kb.io", "mstatefulset.kb.io", "vstatefulset.kb.io")
CONFIG_NAME = "lopa-test-kueue"


def unavailable() -> str | None:
    """Why Kueue cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (a mount namespace for its certificate path)"
    if not shutil.which("unshare"):
        return "needs the unshare command"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "needs overlayfs"
    return None


# The mounts Kueue needs, then Kueue: "$1" is the certificate directory, "$2" the overlay's scratch.
_LAUNCH = """set -e
mkdir -p "$2/upper" "$2/work"
mount -t overlay overlay -o "lowerdir=/etc,upperdir=$2/upper,workdir=$2/work" /etc
mkdir -p /etc/kueue/metrics/certs
mount --bind "$1" /etc/kueue/metrics/certs
shift 2
exec "$@"
"""


def kueue_dir() -> Path:
    result = subprocess.run(["bash", str(SCRIPT), "--print-dir"], capture_output=True, text=True,
                            timeout=60, check=False)
    if result.returncode != 0:
        raise KubeClusterError(f"{SCRIPT} --print-dir failed:\n{result.stderr}")
    return Path(result.stdout.strip().splitlines()[-1])


def ensure_kueue() -> Path:
    """The directory of the controller, CRDs and webhooks, building them first when missing (a cold
    build compiles Kueue from source: minutes on 2 cores; its progress goes to stderr)."""
    directory = kueue_dir()
    if subprocess.run(["bash", str(SCRIPT), "--check"], timeout=60, check=False).returncode == 0:
        return directory
    sys.stderr.write(f"\n[kueue] not built yet; running {SCRIPT}\n")
    result = subprocess.run(["bash", str(SCRIPT)], stdout=subprocess.PIPE, text=True, timeout=3600,
                            check=False)
    if result.returncode != 0:
        raise KubeClusterError(f"{SCRIPT} failed (exit {result.returncode})")
    return Path(result.stdout.strip().splitlines()[-1])


class Kueue:
    def __init__(self, kube: KubeCluster) -> None:
        self.kube = kube
        self.directory = ensure_kueue()
        self.work_dir = kube.work_dir / "kueue"
        self.component: Component | None = None

    @property
    def log_path(self) -> Path:
        return self.kube.log_dir / "kueue.log"

    def logs(self, lines: int = 60) -> str:
        return tail(self.log_path, lines)

    def start(self, timeout: float = 120.0) -> Kueue:
        for crd in sorted((self.directory / "crds").glob("*.yaml")):
            self.kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
        self.kube.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                          *[f"crd/{p.stem.split('_', 1)[1]}.kueue.x-k8s.io" for p in
                            sorted((self.directory / "crds").glob("*.yaml"))])
        webhook_port, health_port = free_ports(2)
        certs = self.work_dir / "certs"
        ca = KeyPair(cert=self.kube.ca_file, key=self.kube.work_dir / "pki" / "ca.key")
        pair = serving_cert(certs, "kueue-webhook", ca, ["127.0.0.1"])
        os.replace(pair.cert, certs / "tls.crt")  # the names controller-runtime's webhook server reads
        os.replace(pair.key, certs / "tls.key")
        config = self.work_dir / "config.yaml"
        config.write_text(yaml.safe_dump(_configuration(webhook_port, health_port, certs)))
        (self.work_dir / "home").mkdir(parents=True, exist_ok=True)
        args = [f"--config={config}", f"--kubeconfig={self.kube.kubeconfig}",
                "--feature-gates=VisibilityOnDemand=false", "--zap-log-level=2"]
        launch = ["--mount", "--propagation", "private", "sh", "-c", _LAUNCH, "kueue",
                  str(certs), str(self.work_dir / "etc"), str(self.directory / "kueue"), *args]
        self.component = spawn("kueue", Path(shutil.which("unshare") or "unshare"), launch, self.log_path,
                               self.work_dir)
        try:
            self._wait_ready(health_port, timeout)
            self.kube.apply(self._webhooks(f"https://127.0.0.1:{webhook_port}"))
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, port: int, timeout: float) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while True:
            assert self.component is not None
            code = self.component.process.poll()
            if code is not None:
                raise KubeClusterError(f"kueue exited with {code}:\n{self.logs()}")
            with contextlib.suppress(OSError), urllib.request.urlopen(
                f"http://127.0.0.1:{port}/readyz", timeout=2
            ) as reply:
                if reply.status == 200:
                    return
            if time.monotonic() > deadline:
                raise KubeClusterError(f"kueue not ready after {timeout:.0f}s:\n{self.logs()}")
            time.sleep(0.5)

    def _webhooks(self, url: str) -> list[dict[str, Any]]:
        """Kueue's webhook configurations, reaching this process at `url` under the cluster's CA."""
        import base64

        bundle = base64.b64encode(self.kube.ca_file.read_bytes()).decode()
        out = []
        for doc in yaml.safe_load_all((self.directory / "webhooks.yaml").read_text()):
            if not doc:
                continue
            doc = copy.deepcopy(doc)
            doc["metadata"] = {"name": f"{CONFIG_NAME}-{doc['kind'].lower()}"}
            hooks = [w for w in doc["webhooks"] if w["name"] in WEBHOOKS]
            for hook in hooks:
                path = hook["clientConfig"]["service"]["path"]
                hook["clientConfig"] = {"url": url + path, "caBundle": bundle}
                if hook["name"] in SCOPED:
                    hook["namespaceSelector"] = {"matchLabels": {NAMESPACE_LABEL: "true"}}
            doc["webhooks"] = hooks
            out.append(doc)
        return out

    def stop(self) -> None:
        for kind in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration"):
            self.kube.kubectl("delete", kind, f"{CONFIG_NAME}-{kind}", "--ignore-not-found", check=False)
        if self.component is not None:
            stop_components([self.component], 15)
            self.component = None


def _configuration(webhook_port: int, health_port: int, certs: Path) -> dict[str, Any]:
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(certs)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "managedJobsNamespaceSelector": {"matchLabels": {NAMESPACE_LABEL: "true"}},
        "integrations": {"frameworks": ["pod", "statefulset"]},
    }
