"""Test helpers that run a real Kubernetes control plane (see `kube.cluster`).

Import as `from kube.cluster import KubeCluster` with `tests/` on sys.path
(tests/operator/conftest.py arranges that).
"""

from .cluster import CommandError, KubeCluster, KubeClusterError, ensure_binaries, find_bin_dir
from .nodes import ASCEND_RESOURCE, DEFAULT_NODES, GPU_RESOURCE, FakeNode

__all__ = [
    "ASCEND_RESOURCE",
    "DEFAULT_NODES",
    "GPU_RESOURCE",
    "CommandError",
    "FakeNode",
    "KubeCluster",
    "KubeClusterError",
    "ensure_binaries",
    "find_bin_dir",
]
