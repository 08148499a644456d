"""Throwaway PKI for a test control plane, made with the `openssl` command-line tool,
and the kubeconfigs that use it.

Every key is ECDSA P-256: far quicker to generate than RSA, and accepted by every
Kubernetes component for TLS, client certificates and service-account token signing.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


class CertError(RuntimeError):
    """openssl is missing or one of its commands failed."""


@dataclass(frozen=True)
class KeyPair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class ClusterPKI:
    ca: KeyPair
    apiserver: KeyPair
    # Client certificates, by component name (admin, kube-controller-manager, ...).
    clients: dict[str, KeyPair]
    # Service-account token signing key and its public half for verification.
    service_account_key: Path
    service_account_pub: Path


def _openssl(*args: str, cwd: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise CertError("the `openssl` command is needed to make the test cluster's certificates")
    result = subprocess.run(
        [openssl, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        raise CertError(f"openssl {' '.join(args)} failed:\n{result.stderr}")


def _new_key(path: Path) -> None:
    _openssl(
        "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path),
        cwd=path.parent,
    )


def _signed_cert(
    directory: Path,
    name: str,
    subject: str,
    ca: KeyPair,
    extensions: str,
) -> KeyPair:
    key = directory / f"{name}.key"
    csr = directory / f"{name}.csr"
    cert = directory / f"{name}.crt"
    ext = directory / f"{name}.ext"
    _new_key(key)
    _openssl("req", "-new", "-key", str(key), "-subj", subject, "-out", str(csr), cwd=directory)
    ext.write_text(extensions)
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(ca.cert), "-CAkey", str(ca.key),
        "-CAcreateserial", "-days", "30", "-sha256", "-extfile", str(ext), "-out", str(cert),
        cwd=directory,
    )
    return KeyPair(cert=cert, key=key)


def serving_cert(directory: Path, name: str, ca: KeyPair, ips: list[str]) -> KeyPair:
    """A server certificate for `ips`, signed by `ca` (an admission webhook's, say)."""
    directory.mkdir(parents=True, exist_ok=True)
    alt_names = ",".join(f"IP:{ip}" for ip in ips)
    return _signed_cert(
        directory, name, f"/CN={name}", ca,
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        f"extendedKeyUsage=serverAuth\nsubjectAltName={alt_names}\n",
    )


# Client identities the components authenticate as: Kubernetes maps the certificate's
# CN to the user and each O to a group, and the API server's bootstrap RBAC policy
# already grants these users what their component needs.
CLIENT_SUBJECTS = {
    "admin": "/O=system:masters/CN=kubernetes-admin",
    "kube-controller-manager": "/CN=system:kube-controller-manager",
    "kube-scheduler": "/CN=system:kube-scheduler",
    # kwok acts as the kubelet of every fake node and patches node and pod status
    # across namespaces, so it runs with cluster-admin rights like upstream's setups.
    "kwok": "/O=system:masters/CN=kwok-controller",
}


def make_pki(directory: Path, apiserver_ips: list[str], apiserver_names: list[str]) -> ClusterPKI:
    directory.mkdir(parents=True, exist_ok=True)
    ca = KeyPair(cert=directory / "ca.crt", key=directory / "ca.key")
    _new_key(ca.key)
    _openssl(
        "req", "-x509", "-new", "-key", str(ca.key), "-subj", "/CN=lopa-test-ca", "-days", "30",
        "-sha256", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        "-out", str(ca.cert),
        cwd=directory,
    )
    alt_names = ",".join([f"IP:{ip}" for ip in apiserver_ips] + [f"DNS:{n}" for n in apiserver_names])
    apiserver = _signed_cert(
        directory, "apiserver", "/CN=kube-apiserver", ca,
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        f"extendedKeyUsage=serverAuth\nsubjectAltName={alt_names}\n",
    )
    client_ext = (
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=clientAuth\n"
    )
    clients = {
        name: _signed_cert(directory, name, subject, ca, client_ext)
        for name, subject in CLIENT_SUBJECTS.items()
    }
    sa_key = directory / "service-account.key"
    sa_pub = directory / "service-account.pub"
    _new_key(sa_key)
    _openssl("pkey", "-in", str(sa_key), "-pubout", "-out", str(sa_pub), cwd=directory)
    return ClusterPKI(
        ca=ca, apiserver=apiserver, clients=clients,
        service_account_key=sa_key, service_account_pub=sa_pub,
    )


def kubeconfig_dict(
    server: str,
    ca_file: Path,
    user: dict[str, Any],
    name: str = "lopa-test",
    namespace: str | None = None,
) -> dict[str, Any]:
    context: dict[str, Any] = {"cluster": name, "user": name}
    if namespace:
        context["namespace"] = namespace
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": {"server": server, "certificate-authority": str(ca_file)}}],
        "users": [{"name": name, "user": user}],
        "contexts": [{"name": name, "context": context}],
        "current-context": name,
    }


def write_kubeconfig(path: Path, config: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
