"""The CRD, the operator's defaults and docs/lopa.yaml agree (no cluster needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from lopa_operator import config
from lopa_operator import spec as specs

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "charts" / "lopa-operator" / "crds" / "lopadeployments.lopa.dev.yaml"


def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD.read_text())


def schema_defaults(schema: dict[str, Any]) -> Any:
    """The object the API server's defaulting would build from an empty one."""
    if schema.get("type") == "object" and "properties" in schema:
        out = {}
        for key, sub in schema["properties"].items():
            value = schema_defaults(sub) if "default" in sub or sub.get("type") == "object" else None
            if "default" in sub and sub.get("type") == "object":
                value = {**(value or {})}
            if value not in (None, {}) or "default" in sub:
                out[key] = value
        return out
    return schema.get("default")


def test_crd_identity_and_columns() -> None:
    doc = crd()
    assert doc["metadata"]["name"] == "lopadeployments.lopa.dev"
    assert doc["spec"]["names"]["shortNames"] == ["lopa"]
    (version,) = doc["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert {"Ready", "Accelerator", "Branches", "Phase", "Age"} <= set(columns)


def test_crd_defaults_equal_operator_defaults() -> None:
    spec_schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    defaults = schema_defaults(spec_schema)
    sections = ("limits", "collective", "failurePolicy", "service", "rollout", "networkPolicy", "scheduling")
    for section in sections:
        assert defaults[section] == specs.DEFAULTS[section], section
    assert defaults["accelerator"] == specs.DEFAULTS["accelerator"]
    assert defaults["branchParallelism"] == specs.DEFAULTS["branchParallelism"]
    assert defaults["replicas"] == specs.DEFAULTS["replicas"]
    assert defaults["imagePullPolicy"] == specs.DEFAULTS["imagePullPolicy"]
    assert defaults["inferencePool"]["enabled"] is specs.DEFAULTS["inferencePool"]["enabled"] is False


def test_decoding_has_no_defaults() -> None:
    # A defaulted decoding key would be rendered into lopa.yaml and override the model's lopa_defaults.json.
    spec_schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for key, field in spec_schema["properties"]["decoding"]["properties"].items():
        assert "default" not in field, key
    assert specs.DEFAULTS["decoding"] == {}
    assert schema_defaults(spec_schema)["decoding"] == {}


def test_one_device_per_worker() -> None:
    spec_schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec_schema["properties"]["accelerator"]["properties"]["devicesPerWorker"]["maximum"] == 1


def test_crd_decoding_fields_cover_docs_config() -> None:
    decoding = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "decoding"
    ]["properties"]
    reference = yaml.safe_load((REPO / "docs" / "lopa.yaml").read_text())
    assert set(config.DECODING_KEYS.values()) == set(reference["decoding"])
    assert set(config.DECODING_KEYS) == set(decoding)
    assert set(config.LIMIT_KEYS.values()) == set(reference["limits"])


def test_manifests_crd_copy_matches_chart() -> None:
    copy = REPO / "manifests" / "crds" / "lopadeployments.lopa.dev.yaml"
    assert copy.read_text() == CRD.read_text(), "run manifests/generate.sh"
