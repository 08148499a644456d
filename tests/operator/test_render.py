"""Unit tests of the pure rendering functions: no cluster needed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lopa_operator import config, names, render
from lopa_operator import spec as specs

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "manifests" / "samples"


def sample(file: str, kind: str = names.KIND) -> dict:
    docs = [d for d in yaml.safe_load_all((SAMPLES / file).read_text()) if d]
    return next(d for d in docs if d["kind"] == kind)


def by_kind(objs: list[dict]) -> dict[str, dict]:
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objs}


def worker_container(objs: list[dict], name: str) -> dict:
    sts = by_kind(objs)[f"StatefulSet/{names.worker_set(name, 0)}"]
    return sts["spec"]["template"]["spec"]["containers"][0]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container["env"]}


def test_children_names_and_contract() -> None:
    objs = render.children("demo", "ns1", {"branchParallelism": 3})
    assert list(by_kind(objs)) == [
        "Secret/demo-0-group",
        "ConfigMap/demo-0-config",
        "StatefulSet/demo-0-worker",
        "Deployment/demo-0-master",
        "Service/demo-workers",
        "Service/demo",
        "Service/demo-master-metrics",
        "NetworkPolicy/demo-0-worker",
        "NetworkPolicy/demo-0-master",
    ]
    kinds = by_kind(objs)
    headless = kinds["Service/demo-workers"]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    sts = kinds["StatefulSet/demo-0-worker"]["spec"]
    assert sts["podManagementPolicy"] == "Parallel" and sts["replicas"] == 3
    assert sts["serviceName"] == "demo-workers"
    worker = sts["template"]["spec"]["containers"][0]
    assert worker["command"] == [
        "lopa",
        "worker",
        "--config",
        "/etc/lopa/lopa.yaml",
        "--rank",
        "$(LOPA_RANK)",
    ]
    rank = env_of(worker)["LOPA_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert rank == "metadata.labels['apps.kubernetes.io/pod-index']"
    master = kinds["Deployment/demo-0-master"]["spec"]
    assert master["strategy"]["type"] == "Recreate"
    assert master["template"]["spec"]["containers"][0]["command"] == [
        "lopa",
        "master",
        "--config",
        "/etc/lopa/lopa.yaml",
    ]
    client = kinds["Service/demo"]["spec"]
    grpc = next(p for p in client["ports"] if p["name"] == "grpc")
    assert grpc == {"name": "grpc", "port": 50051, "targetPort": "grpc", "appProtocol": "grpc"}
    assert [p["name"] for p in client["ports"]] == ["grpc"]  # /metrics is on demo-master-metrics


def test_config_matches_docs_shape() -> None:
    reference = yaml.safe_load((REPO / "docs" / "lopa.yaml").read_text())
    doc = config.render(
        "demo",
        "default",
        specs.with_defaults(
            {"accelerator": {"type": "nvidia"}, "branchParallelism": 2, "tls": {"secretName": "s"},
             "service": {"httpPort": 8000}, "model": {"weights": "fp8"}}  # weights: rendered when set
        ),
        0,
    )

    def shape(d: object) -> object:
        return {k: shape(v) for k, v in d.items()} if isinstance(d, dict) else type(d).__name__

    # Same sections, same keys in the same order, same value types (paths/addresses aside); no
    # performance section: a LoPADeployment sets those switches through its pods' env (spec.env).
    assert list(doc) == [section for section in reference if section != "performance"]
    for section in doc:
        if section != "decoding":
            assert list(doc[section]) == list(reference[section]), section
    # The spec sets no decoding key: none is rendered, the runtime takes them from the model.
    assert doc["decoding"] == {}
    assert doc["limits"] == reference["limits"]
    assert doc["workers"] == reference["workers"]  # demo/default with 2 nccl workers is the docs example


def test_config_hash_changes_with_decoding_only_when_spec_changes() -> None:
    base = {"branchParallelism": 2}
    h1 = render.group_hash("demo", "ns", specs.with_defaults(base))
    assert h1 == render.group_hash("demo", "ns", specs.with_defaults(base))
    h2 = render.group_hash("demo", "ns", specs.with_defaults({**base, "decoding": {"tauConf": 0.8}}))
    assert h1 != h2
    objs = render.children("demo", "ns", {**base, "decoding": {"tauConf": 0.8}})
    for kind in ("StatefulSet/demo-0-worker", "Deployment/demo-0-master"):
        template = by_kind(objs)[kind]["spec"]["template"]
        assert template["metadata"]["annotations"][names.CONFIG_HASH_ANNOTATION] == h2


def test_nvidia_sample_wiring() -> None:
    cr = sample("nvidia.yaml")
    objs = render.children(cr["metadata"]["name"], "ns", cr["spec"])
    worker = worker_container(objs, "d2f-dream")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    env = env_of(worker)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"]["value"] == "1"
    pod = by_kind(objs)["StatefulSet/d2f-dream-0-worker"]["spec"]["template"]["spec"]
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in worker["volumeMounts"]
    cache = next(v for v in pod["volumes"] if v["name"] == "model-cache")
    assert cache["persistentVolumeClaim"] == {"claimName": "d2f-models"}  # written by the init containers
    assert [c["name"] for c in pod["initContainers"]] == ["fetch-model", "fetch-adapter"]
    text = by_kind(objs)["ConfigMap/d2f-dream-0-config"]["data"]["lopa.yaml"]
    doc = yaml.safe_load(text)
    assert doc["workers"]["backend"] == "nccl" and doc["model"]["device"] == "cuda"
    assert doc["model"]["path"] == "/mnt/models/hf/Dream-org/Dream-v0-Base-7B/main"
    assert doc["model"]["adapter"] == "/mnt/models/hf/SJTU-Deng-Lab/D2F_Dream_Base_7B_Lora/main"
    assert doc["workers"]["addresses"][3] == "d2f-dream-0-worker-3.d2f-dream-workers.ns.svc:50052"


def test_ascend_sample_wiring() -> None:
    cr = sample("ascend.yaml")
    objs = render.children(cr["metadata"]["name"], "ns", cr["spec"])
    worker = worker_container(objs, "d2f-dream-ascend")
    assert worker["resources"]["limits"] == {"huawei.com/Ascend910": "1"}
    env = env_of(worker)
    assert env["HCCL_CONNECT_TIMEOUT"]["value"] == "900"
    assert env["HCCL_EXEC_TIMEOUT"]["value"] == "120"
    assert env["HCCL_IF_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert "ASCEND_VISIBLE_DEVICES" not in env  # the device plugin sets it
    doc = yaml.safe_load(by_kind(objs)["ConfigMap/d2f-dream-ascend-0-config"]["data"]["lopa.yaml"])
    assert doc["workers"]["backend"] == "hccl" and doc["model"]["device"] == "npu"


def test_ascend_resource_name_is_configurable() -> None:
    spec = {"accelerator": {"type": "ascend", "resourceName": "huawei.com/Ascend910B"}}
    worker = worker_container(render.children("a", "ns", spec), "a")
    assert worker["resources"]["limits"] == {"huawei.com/Ascend910B": "1"}


def test_cpu_sample_wiring() -> None:
    cr = sample("cpu.yaml")
    objs = render.children(cr["metadata"]["name"], "ns", cr["spec"])
    worker = worker_container(objs, "lopa-cpu")
    assert not any("/" in k for k in worker["resources"].get("limits", {}))  # no device resources
    assert "NCCL_DEBUG" not in env_of(worker)
    doc = yaml.safe_load(by_kind(objs)["ConfigMap/lopa-cpu-0-config"]["data"]["lopa.yaml"])
    assert doc["workers"]["backend"] == "gloo"
    assert doc["model"] == {"path": "", "adapter": "", "dtype": "float32", "device": "cpu"}  # bundled model


def test_user_settings_pass_through() -> None:
    spec = {
        "image": "example/lopa:dev",
        "nodeSelector": {"pool": "a"},
        "tolerations": [{"key": "k", "operator": "Exists"}],
        "affinity": {"nodeAffinity": {}},
        "env": [{"name": "HF_HOME", "value": "/cache"}],
        "service": {"type": "LoadBalancer", "port": 443, "annotations": {"a": "b"}},
        "tls": {"secretName": "lopa-tls", "requireClientCert": True},
    }
    objs = by_kind(render.children("u", "ns", spec))
    pod = objs["StatefulSet/u-0-worker"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "a"} and pod["affinity"]["nodeAffinity"] == {}  # + placement
    assert pod["tolerations"] == [{"key": "k", "operator": "Exists"}]
    assert pod["containers"][0]["image"] == "example/lopa:dev"
    assert env_of(pod["containers"][0])["HF_HOME"]["value"] == "/cache"
    svc = objs["Service/u"]
    assert svc["spec"]["type"] == "LoadBalancer" and svc["metadata"]["annotations"]["a"] == "b"
    assert svc["spec"]["ports"][0]["port"] == 443
    master = objs["Deployment/u-0-master"]["spec"]["template"]["spec"]
    assert {"name": "tls", "secret": {"secretName": "lopa-tls", "defaultMode": 0o400}} in master["volumes"]
    doc = yaml.safe_load(objs["ConfigMap/u-0-config"]["data"]["lopa.yaml"])
    assert doc["tls"]["client_ca"] == "/etc/lopa/tls/ca.crt"
    # kubelet gRPC probes speak no TLS: a TLS master is probed on its plaintext health port.
    assert master["containers"][0]["readinessProbe"]["grpc"] == {"port": names.HEALTH_PORT}
    plain = by_kind(render.children("p", "ns", {}))["Deployment/p-0-master"]["spec"]["template"]["spec"]
    assert plain["containers"][0]["readinessProbe"]["grpc"] == {"port": 50051}


@pytest.mark.parametrize("kind", ["cpu", "nvidia", "ascend"])
def test_default_image_per_accelerator(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(f"LOPA_RUNTIME_IMAGE_{kind.upper()}", raising=False)
    assert specs.image(specs.with_defaults({"accelerator": {"type": kind}})) == specs.DEFAULT_IMAGES[kind]
    monkeypatch.setenv(f"LOPA_RUNTIME_IMAGE_{kind.upper()}", "mirror/lopa:x")
    assert specs.image(specs.with_defaults({"accelerator": {"type": kind}})) == "mirror/lopa:x"


@pytest.mark.parametrize("file", ["cpu.yaml", "nvidia.yaml", "ascend.yaml"])
def test_rendered_config_loads_in_the_runtime(file: str) -> None:
    # The contract with `lopa master`/`lopa worker`: their own loader accepts what we render.
    runtime_config = pytest.importorskip("lopa.serving.shared.config")
    cr = sample(file)
    objs = render.children(cr["metadata"]["name"], "ns", cr["spec"])
    text = by_kind(objs)[f"ConfigMap/{cr['metadata']['name']}-0-config"]["data"]["lopa.yaml"]
    loaded = runtime_config.parse_config(yaml.safe_load(text))
    assert loaded.workers.count == cr["spec"]["branchParallelism"]
    assert loaded.workers.backend == specs.BACKENDS[cr["spec"]["accelerator"]["type"]]
    assert loaded.decoding.branches == cr["spec"]["decoding"]["branches"]


def test_rendered_config_with_tls_loads_in_the_runtime() -> None:
    runtime_config = pytest.importorskip("lopa.serving.shared.config")
    spec = specs.with_defaults({"tls": {"secretName": "s", "requireClientCert": True}})
    loaded = runtime_config.parse_config(config.render("d", "ns", spec, 0))
    assert loaded.tls.enabled and loaded.tls.client_ca.endswith("ca.crt")


def test_cli_render_prints_children_without_a_cluster() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "lopa_operator", "--render", str(SAMPLES / "nvidia.yaml")],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    docs = list(yaml.safe_load_all(out))
    assert [d["kind"] for d in docs] == [
        "Secret", "ConfigMap", "StatefulSet", "Deployment", "Service", "Service", "Service", "NetworkPolicy",
        "NetworkPolicy",
    ]
    assert docs[1]["metadata"]["name"] == "d2f-dream-0-config"
    assert docs[1]["metadata"]["namespace"] == "default"


def test_cpu_sample_serves_the_bundled_models_decoding_defaults(tmp_path: Path) -> None:
    # Decoding keys the spec leaves out stay out of lopa.yaml: `lopa master` fills them from the model's
    # lopa_defaults.json (bundled model: block 8, 32 tokens), not the paper's block 32 / 256 tokens.
    master = pytest.importorskip("lopa.cli.master")
    cr = sample("cpu.yaml")
    doc = config.render(cr["metadata"]["name"], "ns", specs.with_defaults(cr["spec"]), 0)
    assert doc["decoding"] == {"branches": 3}
    path = tmp_path / "lopa.yaml"
    path.write_text(config.dump(doc))
    loaded = master.master_config(str(path))
    assert loaded.decoding.block_size == 8 and loaded.decoding.max_new_tokens == 32
    assert loaded.decoding.branches == 3  # set by the user: kept


def test_decoding_keys_the_spec_sets_are_rendered_as_given() -> None:
    doc = config.render("d", "ns", specs.with_defaults({"decoding": {"blockSize": 32, "tauConf": 1}}), 0)
    assert doc["decoding"] == {"block_size": 32, "tau_conf": 1.0}
    runtime_config = pytest.importorskip("lopa.serving.shared.config")
    assert runtime_config.parse_config(doc).decoding_keys == {"block_size", "tau_conf"}


def test_the_weights_format_is_rendered_only_when_the_spec_sets_it() -> None:
    doc = config.render("d", "ns", specs.with_defaults({"accelerator": {"type": "nvidia"},
                                                        "model": {"weights": "fp8"}}), 0)
    assert doc["model"]["weights"] == "fp8"
    runtime_config = pytest.importorskip("lopa.serving.shared.config")
    assert runtime_config.parse_config(doc).model.weights == "fp8"
    assert set(runtime_config.WEIGHTS) == set(_crd_model()["weights"]["enum"])
    # Left out, the key stays out: the config (and the pods' hash) of an existing spec do not move.
    assert "weights" not in config.render("d", "ns", specs.with_defaults({}), 0)["model"]


def _crd_model() -> dict:
    crd = yaml.safe_load((REPO / "manifests" / "crds" / "lopadeployments.lopa.dev.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "model"]["properties"]


def test_operator_backends_agree_with_the_runtime() -> None:
    # The operator cannot import the runtime (no torch in its image): its device and backend tables
    # are checked against the runtime's one table here instead.
    runtime_config = pytest.importorskip("lopa.serving.shared.config")
    crd = yaml.safe_load((REPO / "manifests" / "crds" / "lopadeployments.lopa.dev.yaml").read_text())
    accelerator = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "accelerator"
    ]["properties"]
    assert set(accelerator["type"]["enum"]) == set(specs.DEVICES) == set(specs.BACKENDS)
    for kind, device in specs.DEVICES.items():
        # the runtime's default backend of the device (its first allowed one)
        assert specs.BACKENDS[kind] == runtime_config.BACKENDS_OF_DEVICE[device][0], kind
    assert set(accelerator["backend"]["enum"]) == set(runtime_config.BACKENDS)


def test_the_rendered_http_bounds_are_the_runtimes_defaults() -> None:
    from lopa.serving.shared.config import MasterConfig

    assert {key: getattr(MasterConfig(), key) for key in config.HTTP_BOUNDS} == config.HTTP_BOUNDS
    assert {key: getattr(MasterConfig(), key) for key in config.GRPC_BOUNDS} == config.GRPC_BOUNDS
