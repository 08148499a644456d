"""Command-line flags of each control plane component (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, kwok) as the test cluster runs them."""

from __future__ import annotations

from pathlib import Path

from .binaries import KWOK_STAGES
from .certs import ClusterPKI
from .nodes import KWOK_ANNOTATION, KWOK_ANNOTATION_VALUE

SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"  # first address of SERVICE_CIDR: the `kubernetes` Service
POD_CIDR = "10.244.0.0/16"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
# The Workload API (scheduling.k8s.io/v1beta1 Workload and PodGroup: gang scheduling), beta and off by
# default in 1.37: the gate on every component (the scheduler's GangScheduling plugin, the
# controller-manager's PodGroup protection) and the beta API served.
FEATURE_GATES = "--feature-gates=GenericWorkload=true"
WORKLOAD_API = "scheduling.k8s.io/v1beta1"


def etcd_args(work_dir: Path, ports: dict[str, int]) -> list[str]:
    client = f"http://127.0.0.1:{ports['etcd-client']}"
    peer = f"http://127.0.0.1:{ports['etcd-peer']}"
    return [
        "--name=lopa-test",
        f"--data-dir={work_dir / 'etcd-data'}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=lopa-test={peer}",
        "--initial-cluster-state=new",
        # Test data is thrown away: skip fsync, which dominates etcd latency on CI disks.
        "--unsafe-no-fsync=true",
        "--log-level=warn",
    ]


def apiserver_args(work_dir: Path, ports: dict[str, int], pki: ClusterPKI) -> list[str]:
    return [
        f"--etcd-servers=http://127.0.0.1:{ports['etcd-client']}",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        f"--secure-port={ports['apiserver']}",
        f"--cert-dir={work_dir / 'pki'}",
        f"--tls-cert-file={pki.apiserver.cert}",
        f"--tls-private-key-file={pki.apiserver.key}",
        f"--client-ca-file={pki.ca.cert}",
        "--authorization-mode=Node,RBAC",
        f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
        f"--service-account-key-file={pki.service_account_pub}",
        f"--service-account-signing-key-file={pki.service_account_key}",
        f"--api-audiences={SERVICE_ACCOUNT_ISSUER}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--allow-privileged=true",
        FEATURE_GATES,
        f"--runtime-config={WORKLOAD_API}=true",
        # The endpoint reconciler would publish 127.0.0.1 as the `kubernetes` Service
        # endpoint, which EndpointSlice validation rejects: nothing in-cluster dials it.
        "--endpoint-reconciler-type=none",
        "--profiling=false",
        "--v=1",
    ]


def controller_manager_args(work_dir: Path, ports: dict[str, int], pki: ClusterPKI) -> list[str]:
    kubeconfig = work_dir / "kubeconfigs" / "kube-controller-manager.kubeconfig"
    return [
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={ports['controller-manager']}",
        f"--cert-dir={work_dir / 'kcm-certs'}",
        "--controllers=*",
        "--use-service-account-credentials=true",
        f"--service-account-private-key-file={pki.service_account_key}",
        f"--root-ca-file={pki.ca.cert}",
        f"--cluster-signing-cert-file={pki.ca.cert}",
        f"--cluster-signing-key-file={pki.ca.key}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--allocate-node-cidrs=false",
        FEATURE_GATES,
        # One controller-manager per cluster: skip the leader-election lease wait.
        "--leader-elect=false",
        "--v=1",
    ]


def scheduler_args(work_dir: Path, ports: dict[str, int]) -> list[str]:
    kubeconfig = work_dir / "kubeconfigs" / "kube-scheduler.kubeconfig"
    return [
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={ports['scheduler']}",
        f"--cert-dir={work_dir / 'scheduler-certs'}",
        "--leader-elect=false",
        FEATURE_GATES,
        "--v=1",
    ]


def kwok_args(work_dir: Path, bin_dir: Path, ports: dict[str, int]) -> list[str]:
    kubeconfig = work_dir / "kubeconfigs" / "kwok.kubeconfig"
    return [
        f"--kubeconfig={kubeconfig}",
        f"--config={bin_dir / KWOK_STAGES}",
        "--manage-all-nodes=false",
        f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}={KWOK_ANNOTATION_VALUE}",
        f"--cidr={POD_CIDR}",
        "--node-ip=127.0.0.1",
        # kwok serves the fake kubelets' API (logs, exec) here and advertises the
        # same port as every fake node's kubelet endpoint.
        f"--server-address=127.0.0.1:{ports['kwok']}",
        f"--node-port={ports['kwok']}",
    ]
