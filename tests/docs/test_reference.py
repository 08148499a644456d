"""The reference generator (tools/docs): what it reads from each source, and the staleness check."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest
import yaml

from tools.docs import gen_reference, ref_cli, ref_config, ref_crd, ref_grpc, ref_metrics

REPO = Path(__file__).resolve().parents[2]


def test_a_new_cli_flag_shows_up_in_the_cli_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    from lopa import cli

    real = cli.build_parser

    def with_new_flag() -> argparse.ArgumentParser:
        parser = real()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                action.choices["serve"].add_argument("--brand-new-flag", help="a flag added to the code")
        return parser

    monkeypatch.setattr(cli, "build_parser", with_new_flag)
    page = ref_cli.render()
    serve = page[page.index("### `lopa serve`"):page.index("### `lopa master`")]
    assert "--brand-new-flag" in serve and "a flag added to the code" in serve
    # every subcommand, nested ones included, and the operator's command
    for heading in ("### `lopa generate`", "#### `lopa bench tpf`", "#### `lopa client generate`",
                    "## `lopa-operator`"):
        assert heading in page


def test_a_config_key_must_be_in_docs_lopa_yaml(tmp_path: Path) -> None:
    code = ref_config.code_keys()
    _, sections = ref_config.parse(REPO / "docs" / "lopa.yaml")
    ref_config.check(sections, code)  # the committed file documents every key
    code["master"]["brand_new_key"] = 1
    with pytest.raises(ref_config.ConfigDocError, match=r"master\.brand_new_key: read by the code"):
        ref_config.check(sections, code)
    documented = tmp_path / "lopa.yaml"
    text = (REPO / "docs" / "lopa.yaml").read_text()
    documented.write_text(text.replace("master:\n", "master:\n  brand_new_key: 1          # a new key\n"))
    _, sections = ref_config.parse(documented)
    ref_config.check(sections, code)  # documented and read: the page gets its row
    not_read = r"master\.brand_new_key: in docs/lopa.yaml, not read by the code"
    with pytest.raises(ref_config.ConfigDocError, match=not_read):
        ref_config.render(documented)  # documented, not read by the code as it is


def test_comments_of_the_config_file_go_to_their_key() -> None:
    _, sections = ref_config.parse(REPO / "docs" / "lopa.yaml")
    keys = {f"{s.name}.{k.name}": " ".join(k.text) for s in sections for k in s.keys}
    assert "requests decoding at once" in keys["limits.max_batch"]  # the block above it
    assert "keepalive pings" in keys["workers.step_timeout_s"]  # the lines continuing its comment
    assert "lopa_defaults.json" in " ".join(next(s for s in sections if s.name == "decoding").text)


def test_a_new_crd_field_shows_up_with_its_schema(tmp_path: Path) -> None:
    crd = yaml.safe_load((REPO / "manifests" / "crds" / "lopadeployments.lopa.dev.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["brandNewField"] = {"type": "integer", "minimum": 2, "default": 3,
                                           "description": "a field added to the schema"}
    (tmp_path / "crd.yaml").write_text(yaml.safe_dump(crd))
    page = ref_crd.render(tmp_path, Path("crd.yaml"), ref_config.code_keys())
    assert "| `spec.brandNewField` | integer | `3` | minimum: `2` | a field added to the schema |" in page
    assert "| `spec.limits.maxBatch` |" in page and "config key [`limits.max_batch`]" in page
    assert "spec.decoding.branches must not exceed spec.limits.maxBranches" in page  # a CEL rule


def test_the_grpc_reference_has_every_rpc_and_the_field_comments() -> None:
    page = ref_grpc.render(REPO / "protos")
    for rpc in ("`Generate`", "`GenerateStream`", "`GetModelInfo`", "`Steps`"):
        assert rpc in page
    assert "| `branches` | 2 | `optional uint32` | lookahead branches k (the anchor is not counted) |" in page
    assert "| `GenerateStream` | `GenerateRequest` | `stream GenerateChunk` |" in page


def test_the_metrics_reference_names_every_series_with_its_labels() -> None:
    page = ref_metrics.render()
    assert "| `lopa_requests_total` | counter | `outcome` | Requests by outcome |" in page
    assert "| `vllm:request_success_total` | counter | `model_name`, `finished_reason` |" in page
    assert "| `lopa_worker_forwards_total` | counter | `path` |" in page
    assert "| `lopa_operator_phase` | gauge | `namespace`, `name`, `phase` |" in page


def test_the_check_names_a_stale_page(tmp_path: Path) -> None:
    shutil.copytree(REPO / gen_reference.REFERENCE, tmp_path, dirs_exist_ok=True)
    assert gen_reference.main(["--check", "--out", str(tmp_path)]) == 0
    (tmp_path / "metrics.md").write_text((tmp_path / "metrics.md").read_text() + "hand edit\n")
    (tmp_path / "grpc.md").unlink()
    assert gen_reference.stale(tmp_path) == ["grpc.md", "metrics.md"]
    assert gen_reference.main(["--check", "--out", str(tmp_path)]) == 1
