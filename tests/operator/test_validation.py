"""Invalid LoPADeployments are rejected by the API server (schema + CEL) with the field named."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from lopa_op_helpers import ensure_chart

from kube.cluster import KubeCluster


def manifest(spec: dict[str, Any], name: str = "bad") -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "lopa.dev/v1alpha1",
            "kind": "LoPADeployment",
            "metadata": {"name": name},
            "spec": spec,
        }
    )


CASES = [
    ("zero-workers", {"branchParallelism": 0}, "spec.branchParallelism"),
    ("tau-above-one", {"decoding": {"tauConf": 1.5}}, "spec.decoding.tauConf"),
    ("tau-negative", {"decoding": {"tauAdd": -0.1}}, "spec.decoding.tauAdd"),
    ("hccl-on-nvidia", {"accelerator": {"type": "nvidia", "backend": "hccl"}}, "spec.accelerator.backend"),
    ("nccl-on-ascend", {"accelerator": {"type": "ascend", "backend": "nccl"}}, "spec.accelerator.backend"),
    ("nccl-on-cpu", {"accelerator": {"type": "cpu", "backend": "nccl"}}, "spec.accelerator.backend"),
    ("unknown-accelerator", {"accelerator": {"type": "tpu"}}, "spec.accelerator.type"),
    (
        "branches-over-limit",
        {"decoding": {"branches": 20}, "limits": {"maxBranches": 15}},
        "spec.decoding.branches",
    ),
    ("relative-model-path", {"model": {"path": "models/x"}}, "spec.model.path"),
    # Before: admitted, then every apply failed (duplicate mountPath) or the config was hidden.
    ("models-over-config", {"model": {"pvc": {"claimName": "m", "mountPath": "/etc/lopa"}}},
     "spec.model.pvc.mountPath"),
    ("models-over-shm", {"model": {"pvc": {"claimName": "m", "mountPath": "/dev/shm/"}}},
     "spec.model.pvc.mountPath"),
    # The same directories spelt otherwise (before: admitted, then mounted beside the config).
    ("models-over-config-two-slashes", {"model": {"pvc": {"claimName": "m", "mountPath": "//etc/lopa"}}},
     "spec.model.pvc.mountPath"),
    ("models-over-config-dot-dot", {"model": {"pvc": {"claimName": "m", "mountPath": "/x/../etc/lopa"}}},
     "spec.model.pvc.mountPath"),
    ("models-at-root", {"model": {"pvc": {"claimName": "m", "mountPath": "/"}}}, "spec.model.pvc.mountPath"),
    ("pvc-without-path", {"model": {"pvc": {"claimName": "m"}}}, "spec.model.path"),
    ("adapter-without-base", {"model": {"adapter": "/models/lora"}}, "spec.model.adapter"),
    ("bad-conf", {"decoding": {"conf": "entropy"}}, "spec.decoding.conf"),
    ("unknown-weights", {"model": {"weights": "int4"}}, "spec.model.weights"),
    ("fp8-on-ascend", {"accelerator": {"type": "ascend"}, "model": {"weights": "fp8"}},
     "spec.model.weights fp8 runs on nvidia GPUs or cpu, not on ascend"),
    ("bad-shm", {"accelerator": {"type": "nvidia", "shmSize": "lots"}}, "spec.accelerator.shmSize"),
    (
        "two-devices-per-worker",
        {"accelerator": {"type": "nvidia", "devicesPerWorker": 2}},
        "spec.accelerator.devicesPerWorker",
    ),
    (
        "operator-owned-env",
        {"env": [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "LOPA_RANK", "value": "3"}]},
        "LOPA_RANK, LOPA_WORLD_SIZE, LOPA_POD_NAME and LOPA_NAMESPACE are set by the",
    ),
    # An env item is a container's EnvVar (before: admitted, then every pod apply refused).
    ("env-without-a-name", {"env": [{"name": "", "value": "1"}]}, "spec.env[0].name"),
    ("env-name-with-equals", {"env": [{"name": "A=B", "value": "1"}]}, "spec.env[0].name"),
    ("env-value-and-value-from", {"env": [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {}}}]},
     "an item sets value or valueFrom, not both"),
    (
        "block-over-max-new-tokens",
        {"decoding": {"blockSize": 64, "maxNewTokens": 56}},
        "spec.decoding.blockSize must not exceed spec.decoding.maxNewTokens",
    ),
    # With decoding.maxNewTokens left out the answer length still cannot exceed limits.maxNewTokens
    # (the model's default is capped to it): the runtime refuses the block size at start.
    (
        "block-over-limits-max-new-tokens",
        {"decoding": {"blockSize": 64}, "limits": {"maxNewTokens": 32}},
        "spec.decoding.blockSize must not exceed spec.limits.maxNewTokens",
    ),
    # The workers get top_k as a uint32 (worker.proto Begin): a larger one failed every request.
    ("top-k-over-uint32", {"decoding": {"topK": 2**32}}, "spec.decoding.topK"),
    # The operator adds the device request into the worker's limits and requests: anything but a
    # map there made every reconcile raise (AttributeError) instead of reaching the API server.
    (
        "worker-limits-not-a-map",
        {"accelerator": {"type": "nvidia"}, "resources": {"limits": "8Gi"}},
        "spec.resources.limits",
    ),
    ("worker-requests-not-a-map", {"resources": {"requests": ["cpu"]}}, "spec.resources.requests"),
    ("http-on-the-grpc-port", {"service": {"port": 8000, "httpPort": 8000}},
     "service.httpPort must differ from service.port"),
    ("max-batch-zero", {"limits": {"maxBatch": 0}}, "spec.limits.maxBatch"),
    ("max-batch-over-256", {"limits": {"maxBatch": 257}}, "spec.limits.maxBatch"),
    ("negative-step-tokens", {"limits": {"maxStepTokens": -1}}, "spec.limits.maxStepTokens"),
    ("step-tokens-below-a-block", {"decoding": {"blockSize": 32}, "limits": {"maxStepTokens": 16}},
     "spec.limits.maxStepTokens must be 0 (the device's default) or at least spec.decoding.blockSize"),
    # Over a week: the runtime refuses it at start (torch's collective timeouts overflow near 25 days).
    ("request-timeout-over-a-week", {"limits": {"requestTimeoutSeconds": 604801}},
     "spec.limits.requestTimeoutSeconds"),
    ("step-timeout-over-a-week", {"collective": {"stepTimeoutSeconds": 10**9}},
     "spec.collective.stepTimeoutSeconds"),
    ("negative-replicas", {"replicas": -1}, "spec.replicas"),
    ("replicas-over-100", {"replicas": 101}, "spec.replicas"),
    ("max-unavailable-zero", {"rollout": {"maxUnavailable": 0}}, "spec.rollout.maxUnavailable"),
    ("max-unavailable-negative", {"rollout": {"maxUnavailable": -2}}, "spec.rollout.maxUnavailable"),
    (
        "backoff-over-max",
        {"failurePolicy": {"backoffSeconds": 600, "maxBackoffSeconds": 60}},
        "spec.failurePolicy.backoffSeconds",
    ),
    ("models-over-the-group-secret", {"model": {"pvc": {"claimName": "m", "mountPath": "/etc/lopa/group"}}},
     "spec.model.pvc.mountPath"),
    ("models-over-tmp", {"model": {"pvc": {"claimName": "m", "mountPath": "/tmp/"}}},
     "spec.model.pvc.mountPath"),
    # Security overrides: each would have been merged over the defaults into pods the API server
    # or the kubelet refuses.
    ("privileged-without-escalation", {"securityContext": {"privileged": True}},
     "spec.securityContext.privileged needs allowPrivilegeEscalation: true"),
    ("root-pod-still-non-root", {"podSecurityContext": {"runAsUser": 0}},
     "runAsUser 0 (root) needs runAsNonRoot: false"),
    ("root-container-still-non-root", {"securityContext": {"runAsUser": 0},
                                       "podSecurityContext": {"runAsNonRoot": True}},
     "runAsUser 0 (root) needs runAsNonRoot: false"),
    ("uid-not-a-number", {"podSecurityContext": {"runAsUser": "root"}}, "spec.podSecurityContext.runAsUser"),
    ("negative-group", {"podSecurityContext": {"supplementalGroups": [-1]}},
     "spec.podSecurityContext.supplementalGroups[0]"),
    ("unknown-seccomp-type", {"podSecurityContext": {"seccompProfile": {"type": "Default"}}},
     "spec.podSecurityContext.seccompProfile.type"),
    ("localhost-seccomp-without-profile", {"securityContext": {"seccompProfile": {"type": "Localhost"}}},
     "localhostProfile goes with type Localhost"),
    ("capabilities-not-a-list", {"securityContext": {"capabilities": {"add": "NET_ADMIN"}}},
     "spec.securityContext.capabilities.add"),
    # NetworkPolicy peers and the InferencePool.
    ("peer-without-a-selector", {"networkPolicy": {"clientFrom": [{}]}},
     "a peer sets podSelector, namespaceSelector or ipBlock"),
    ("ip-block-beside-a-selector",
     {"networkPolicy": {"clientFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]}},
     "a peer's ipBlock stands alone"),
    ("bad-selector-operator",
     {"networkPolicy": {"metricsFrom": [
         {"podSelector": {"matchExpressions": [{"key": "a", "operator": "Is"}]}}]}},
     "spec.networkPolicy.metricsFrom[0].podSelector.matchExpressions[0].operator"),
    ("pool-without-a-picker", {"service": {"httpPort": 8000}, "inferencePool": {"enabled": True}},
     "spec.inferencePool.endpointPicker is required"),
    ("pool-without-http", {"inferencePool": {"enabled": True, "endpointPicker": {"name": "epp"}}},
     "spec.inferencePool needs spec.service.httpPort"),
    # Model URIs: a shape the init container could not fetch is refused before any pod exists.
    ("hf-without-org", {"model": {"uri": "hf://Dream-v0-Base-7B"}}, "spec.model.uri"),
    ("s3-uri", {"model": {"uri": "s3://bucket/model"}}, "must be hf://org/name[@revision], pvc://claim/path"),
    ("relative-uri", {"model": {"uri": "models/dream"}}, "spec.model.uri"),
    ("hf-revision-dot-dot", {"model": {"uri": "hf://org/m@../../etc"}}, "must hold no . or .. segment"),
    ("pvc-empty-segment", {"model": {"uri": "pvc://models//dream"}}, "spec.model.uri"),
    ("bad-adapter-uri", {"model": {"uri": "hf://org/m", "adapterUri": "ftp://x/y"}}, "spec.model.adapterUri"),
    ("uri-beside-path", {"model": {"uri": "hf://org/m", "path": "/models/m"}},
     "spec.model.uri and spec.model.adapterUri replace spec.model.path, adapter and pvc"),
    ("adapter-uri-without-uri", {"model": {"adapterUri": "hf://org/lora"}},
     "spec.model.adapterUri needs spec.model.uri"),
    ("hub-endpoint-not-http", {"model": {"uri": "hf://org/m", "huggingFace": {"endpoint": "hub.local"}}},
     "spec.model.huggingFace.endpoint"),
    ("token-secret-without-name", {"model": {"uri": "hf://org/m", "huggingFace": {"tokenSecret": {}}}},
     "spec.model.huggingFace.tokenSecret.name"),
    ("cache-size-not-a-quantity", {"model": {"uri": "hf://org/m", "cache": {"sizeLimit": "big"}}},
     "spec.model.cache.sizeLimit must be a quantity"),
    # Scheduling and topology.
    ("unknown-gang", {"scheduling": {"gang": "Volcano"}}, "spec.scheduling.gang"),
    ("kueue-without-queue", {"scheduling": {"gang": "Kueue"}},
     "spec.scheduling.queueName (a Kueue LocalQueue"),
    ("queue-without-kueue", {"scheduling": {"queueName": "gpus"}},
     "spec.scheduling.queueName applies only to gang: Kueue"),
    ("topology-without-key", {"placement": {"topology": {"mode": "Required"}}},
     "spec.placement.topology.key"),
    ("topology-key-not-a-label", {"placement": {"topology": {"key": "rack name"}}},
     "spec.placement.topology.key"),
    ("topology-unknown-mode", {"placement": {"topology": {"key": "rack", "mode": "Always"}}},
     "spec.placement.topology.mode"),
]


@pytest.fixture(scope="module")
def crd_installed(kube: KubeCluster) -> None:
    ensure_chart(kube)


@pytest.fixture(scope="module")
def shared_namespace(kube: KubeCluster) -> Iterator[str]:
    # Rejected objects leave nothing behind: one namespace serves every case (fast).
    name = f"t-validation-{secrets.token_hex(3)}"
    kube.kubectl("create", "namespace", name)
    yield name
    kube.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.mark.parametrize(("case", "spec", "field"), CASES, ids=[c[0] for c in CASES])
def test_invalid_spec_rejected_naming_field(
    kube: KubeCluster, crd_installed: None, shared_namespace: str, case: str, spec: dict[str, Any], field: str
) -> None:
    result = kube.kubectl(
        "create", "-n", shared_namespace, "-f", "-", input=manifest(spec, case), check=False
    )
    assert result.returncode != 0, f"{case} was accepted"
    assert "is invalid" in result.stderr, result.stderr
    assert field in result.stderr, result.stderr


def test_name_too_long_rejected(kube: KubeCluster, crd_installed: None, shared_namespace: str) -> None:
    result = kube.kubectl(
        "create", "-n", shared_namespace, "-f", "-", input=manifest({}, "x" * 41), check=False
    )
    assert result.returncode != 0 and "metadata.name" in result.stderr, result.stderr


@pytest.mark.parametrize("name", ["my.model", "1model"])
def test_name_not_a_dns_label_rejected(
    kube: KubeCluster, crd_installed: None, shared_namespace: str, name: str
) -> None:
    # The name prefixes Services (`<name>-workers`): a dotted name would pass and then stall the CR.
    result = kube.kubectl("create", "-n", shared_namespace, "-f", "-", input=manifest({}, name), check=False)
    assert result.returncode != 0, f"{name} was accepted"
    assert "metadata.name must be a DNS-1035 label" in result.stderr, result.stderr


def test_block_size_alone_or_equal_is_accepted(
    kube: KubeCluster, crd_installed: None, shared_namespace: str
) -> None:
    accepted = (("block-only", {"blockSize": 64}), ("block-eq", {"blockSize": 8, "maxNewTokens": 8}))
    for name, decoding in accepted:
        kube.kubectl(
            "create",
            "--dry-run=server",
            "-n",
            shared_namespace,
            "-f",
            "-",
            input=manifest({"decoding": decoding}, name),
        )


def test_a_misspelt_env_key_is_refused_naming_it(
    kube: KubeCluster, crd_installed: None, shared_namespace: str
) -> None:
    spec = {"env": [{"name": "NCCL_DEBUG", "vaule": "INFO"}]}
    result = kube.kubectl("create", "-n", shared_namespace, "-f", "-", input=manifest(spec, "env-typo"),
                          check=False)
    assert result.returncode != 0 and 'unknown field "spec.env[0].vaule"' in result.stderr, result.stderr


def test_a_misspelt_security_override_is_refused_naming_it(
    kube: KubeCluster, crd_installed: None, shared_namespace: str
) -> None:
    spec = {"securityContext": {"readOnlyRootFileSystem": False}}
    result = kube.kubectl("create", "-n", shared_namespace, "-f", "-", input=manifest(spec, "sc-typo"),
                          check=False)
    assert result.returncode != 0, result.stdout
    assert 'unknown field "spec.securityContext.readOnlyRootFileSystem"' in result.stderr, result.stderr


def test_accelerator_overrides_are_accepted(
    kube: KubeCluster, crd_installed: None, shared_namespace: str
) -> None:
    """What an Ascend node may need (docs/guides/security.md, "Pod security"): the driver's group, or
    root."""
    ascend = {"type": "ascend"}
    for name, spec in (
        ("ascend-group", {"accelerator": ascend, "podSecurityContext": {"supplementalGroups": [1000]}}),
        ("ascend-root", {"accelerator": ascend,
                         "podSecurityContext": {"runAsNonRoot": False, "runAsUser": 0, "runAsGroup": 0},
                         "securityContext": {"readOnlyRootFilesystem": False}}),
        ("localhost-seccomp", {"securityContext": {"seccompProfile": {"type": "Localhost",
                                                                      "localhostProfile": "lopa.json"}}}),
    ):
        kube.kubectl("create", "--dry-run=server", "-n", shared_namespace, "-f", "-",
                     input=manifest(spec, name))


def test_user_env_other_than_the_wiring_is_accepted(
    kube: KubeCluster, crd_installed: None, shared_namespace: str
) -> None:
    env = [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "LOPA_EXTRA", "value": "1"},
           {"name": "LOPA_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    spec = {"accelerator": {"type": "nvidia"}, "env": env}
    kube.kubectl(
        "create", "--dry-run=server", "-n", shared_namespace, "-f", "-", input=manifest(spec, "env-ok")
    )


def test_fp8_weights_are_accepted_on_nvidia_and_cpu(
    kube: KubeCluster, crd_installed: None, shared_namespace: str
) -> None:
    for kind in ("nvidia", "cpu"):
        spec = {"accelerator": {"type": kind}, "model": {"weights": "fp8"}}
        result = kube.kubectl("create", "--dry-run=server", "-o", "json", "-n", shared_namespace, "-f", "-",
                              input=manifest(spec, f"fp8-{kind}"))
        assert yaml.safe_load(result.stdout)["spec"]["model"]["weights"] == "fp8"


def test_model_uris_scheduling_and_topology_are_accepted(
    kube: KubeCluster, crd_installed: None, shared_namespace: str
) -> None:
    for name, spec in (
        ("hf-pinned", {"model": {"uri": "hf://Dream-org/Dream-v0-Base-7B@" + "0" * 40,
                                 "adapterUri": "hf://SJTU-Deng-Lab/D2F_Dream_Base_7B_Lora@refs/pr/1",
                                 "cache": {"claimName": "models"},
                                 "huggingFace": {"endpoint": "https://hf-mirror.com",
                                                 "tokenSecret": {"name": "hf-token"}}}}),
        ("pvc-uri", {"model": {"uri": "pvc://models/Dream-v0-Base-7B", "adapterUri": "/opt/lora"}}),
        ("path-uri", {"model": {"uri": "/models/dream"}}),
        ("workload-gang", {"scheduling": {"gang": "Workload", "priorityClassName": "inference"},
                           "placement": {"topology": {"key": "topology.kubernetes.io/zone"}}}),
        ("kueue-gang", {"scheduling": {"gang": "Kueue", "queueName": "gpus"},
                        "placement": {"sameNode": "None", "topology": {"key": "rack", "mode": "Preferred"}}}),
    ):
        kube.kubectl("create", "--dry-run=server", "-n", shared_namespace, "-f", "-",
                     input=manifest(spec, name))


def test_minimal_spec_gets_defaults(kube: KubeCluster, crd_installed: None, namespace: str) -> None:
    kube.kubectl("create", "-n", namespace, "-f", "-", input=manifest({}, "minimal"))
    spec = kube.get_json("lopa", "minimal", "-n", namespace)["spec"]
    assert spec["branchParallelism"] == 1 and spec["accelerator"]["type"] == "cpu"
    assert spec["decoding"] == {}  # no decoding defaults: the runtime takes the model's own
    assert spec["failurePolicy"]["maxGroupRestarts"] == 5 and spec["service"]["port"] == 50051
    assert spec["scheduling"] == {"gang": "None"}
    kube.kubectl("delete", "lopa", "minimal", "-n", namespace, "--wait=false")
