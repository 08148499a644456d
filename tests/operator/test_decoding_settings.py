"""Every decoding setting is listed everywhere settings are listed.

DecodingParams is the one declaration; each place that must name every setting (the CLI flags'
help, the client's overrides, the wire, the OpenAI body, the operator's keys, the CRD, the config
reference) is checked against it, so a setting added in one place and forgotten in another fails
here, naming the place.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import yaml

from lopa.cli import client as client_cli
from lopa.cli.decoding_flags import HELP
from lopa.params import DecodingParams
from lopa.proto import lopa_pb2
from lopa.serving.master.api import openai_body
from lopa_operator import config as operator_config

REPO = Path(__file__).resolve().parents[2]
SETTINGS = {f.name for f in fields(DecodingParams)}
PER_REQUEST = SETTINGS - {"max_new_tokens"}  # a request's budget travels beside the overrides


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def crd_decoding() -> set[str]:
    crd = yaml.safe_load((REPO / "charts/lopa-operator/crds/lopadeployments.lopa.dev.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return set(spec["properties"]["decoding"]["properties"])


def test_every_place_lists_every_decoding_setting() -> None:
    docs = yaml.safe_load((REPO / "docs/lopa.yaml").read_text())["decoding"]
    places = {
        "lopa.cli.decoding_flags.HELP": set(HELP),
        "docs/lopa.yaml decoding": set(docs),
        "lopa_operator.config.DECODING_KEYS (values)": set(operator_config.DECODING_KEYS.values()),
        "lopa_operator.config.DECODING_KEYS (camelCase keys)": {
            snake for key, snake in operator_config.DECODING_KEYS.items() if key == camel(snake)},
        "the CRD's spec.decoding": {s for s in SETTINGS if camel(s) in crd_decoding()},
        "lopa.cli.client.OVERRIDES + --max-new-tokens": {*client_cli.OVERRIDES, "max_new_tokens"},
        "lopa.v1.DecodingOverrides + GenerateRequest.max_new_tokens": {
            *lopa_pb2.DecodingOverrides.DESCRIPTOR.fields_by_name, "max_new_tokens"},
        "the OpenAI body (LOPA_FIELDS + OPENAI_SAMPLING + max_tokens)": {
            *openai_body.LOPA_FIELDS, *openai_body.OPENAI_SAMPLING, "max_new_tokens"},
    }
    missing = {place: sorted(SETTINGS - listed) for place, listed in places.items() if SETTINGS - listed}
    extra = {place: sorted(listed - SETTINGS) for place, listed in places.items() if listed - SETTINGS}
    assert not missing, f"settings missing from: {missing}"
    assert not extra, f"unknown settings in: {extra}"
    assert set(operator_config.DECODING_KEYS) == crd_decoding()
    float_settings = {f.name for f in fields(DecodingParams) if f.type in (float, "float")}
    assert float_settings == operator_config.FLOAT_KEYS, "lopa_operator.config.FLOAT_KEYS"
