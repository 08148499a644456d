"""The fake nodes of the test cluster: kwok plays their kubelets.

Capacities follow real machines (8-GPU H100 servers, 8-NPU Ascend 910 servers, plain
CPU workers) so the scheduler's fit decisions in tests look like production ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# kwok only manages nodes carrying this annotation (see KubeCluster's kwok flags), so a
# test can also create nodes that kwok leaves alone (e.g. to test NotReady handling).
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_ANNOTATION_VALUE = "fake"

GPU_RESOURCE = "nvidia.com/gpu"
ASCEND_RESOURCE = "huawei.com/Ascend910"


@dataclass(frozen=True)
class FakeNode:
    name: str
    # Extra labels beyond the well-known kubernetes.io/* ones every node gets.
    labels: dict[str, str]
    capacity: dict[str, str]
    # Accelerator resource name -> count, empty for CPU-only nodes.
    accelerators: dict[str, int] = field(default_factory=dict)
    arch: str = "amd64"

    def manifest(self) -> dict[str, Any]:
        labels = {
            "kubernetes.io/hostname": self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": self.arch,
            "type": "kwok",
            **self.labels,
        }
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "labels": labels,
                "annotations": {
                    KWOK_ANNOTATION: KWOK_ANNOTATION_VALUE,
                    "node.alpha.kubernetes.io/ttl": "0",
                },
            },
            "spec": {},
            # Node creation keeps status (a kubelet registers itself this way); kwok's
            # node-initialize stage keeps capacity/allocatable and fills in conditions.
            "status": {"capacity": dict(self.capacity), "allocatable": dict(self.capacity)},
        }


def _gpu_node(index: int) -> FakeNode:
    return FakeNode(
        name=f"kwok-gpu-{index}",
        labels={
            "node.kubernetes.io/instance-type": "gpu-h100x8",
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
            "nvidia.com/gpu.count": "8",
            "nvidia.com/gpu.memory": "81559",
        },
        capacity={
            "cpu": "192",
            "memory": "2048Gi",
            "pods": "110",
            "ephemeral-storage": "3500Gi",
            GPU_RESOURCE: "8",
        },
        accelerators={GPU_RESOURCE: 8},
    )


def _ascend_node(index: int) -> FakeNode:
    return FakeNode(
        name=f"kwok-ascend-{index}",
        labels={
            "node.kubernetes.io/instance-type": "ascend-910x8",
            # The label Huawei's Ascend device plugin and MindX schedulers select on.
            "accelerator": "huawei-Ascend910",
            "huawei.com/Ascend910.present": "true",
        },
        capacity={
            "cpu": "192",
            "memory": "1536Gi",
            "pods": "110",
            "ephemeral-storage": "3500Gi",
            ASCEND_RESOURCE: "8",
        },
        accelerators={ASCEND_RESOURCE: 8},
        arch="arm64",  # Ascend 910 servers are Kunpeng (ARM) machines
    )


def _cpu_node(index: int) -> FakeNode:
    return FakeNode(
        name=f"kwok-cpu-{index}",
        labels={"node.kubernetes.io/instance-type": "cpu-32x128"},
        capacity={"cpu": "32", "memory": "128Gi", "pods": "110", "ephemeral-storage": "500Gi"},
    )


DEFAULT_NODES: tuple[FakeNode, ...] = (
    _gpu_node(0),
    _gpu_node(1),
    _ascend_node(0),
    _ascend_node(1),
    _cpu_node(0),
    _cpu_node(1),
)
