"""The YAML config file both roles read (lopa.serving.shared.config): the reference file, errors
naming the key, ranges, the model's own decoding defaults."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from lopa.host.device import resolve_device
from lopa.params import DecodingParams
from lopa.performance import Switches
from lopa.serving.shared import device_choice
from lopa.serving.shared.config import AUTO, ConfigError, backend_for, load_config, parse_config

REPO = Path(__file__).resolve().parents[2]


def test_the_reference_config_file_parses() -> None:
    config = load_config(REPO / "docs" / "lopa.yaml")
    assert config.workers.count == len(config.workers.addresses) == 2
    assert config.decoding.branches == 7 and config.limits.queue_size == 64 and config.tls.enabled
    assert config.performance == Switches()  # the file spells out the defaults


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"workers": {"count": 2}}, "workers.addresses"),
        ({"workers": {"backend": "mpi"}}, "workers.backend"),
        ({"decoding": {"tau_conf": 2}}, "decoding.tau_conf"),
        ({"decoding": {"speed": 1}}, "decoding.speed"),
        ({"model": {"dtype": "float32"}, "extra": {}}, "extra"),
        ({"performance": {"kernels": "cuda"}}, "performance.kernels: must be one of triton, torch"),
        ({"performance": {"cuda_graphs": "sometimes"}}, "performance.cuda_graphs"),
        ({"performance": {"cuda_graph_tokens": -2}}, "performance.cuda_graph_tokens"),
        ({"performance": {"torch_compile": "yes"}}, "performance.torch_compile: must be true or false"),
    ],
)
def test_config_errors_name_the_key(raw: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        parse_config(raw)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"model": {"dtype": "float8"}}, r"model\.dtype: must be one of float32, bfloat16, float16, got 'fl"),
        ({"model": {"weights": "int4"}}, r"model\.weights: must be one of dtype, fp8, got 'int4'"),
        ({"model": {"device": "tpu"}},
         r"model\.device: must be cpu, cuda\[:N\], npu\[:N\] or auto, got 'tpu'"),
        ({"model": {"device": "cuda:x"}}, r"model\.device: must be cpu"),
        ({"model": {"device": "cuda"}, "workers": {"backend": "hccl"}},
         r"workers\.backend: 'hccl' does not match model\.device 'cuda' \(use nccl, or gloo for sev"),
        ({"model": {"device": "npu"}, "workers": {"backend": "gloo"}},
         r"workers\.backend: 'gloo' does not match model\.device 'npu' \(use hccl\)"),
        ({"model": {"device": "cpu"}, "workers": {"backend": "nccl"}},
         r"workers\.backend: 'nccl' does not match model\.device 'cpu' \(use gloo\)"),
        ({"master": {"listen": "not-an-address"}}, r"master\.listen: must be HOST:PORT"),
        ({"master": {"listen": "127.0.0.1:99999"}}, r"master\.listen: port must be in \[1, 65535\], got 9"),
        ({"master": {"metrics_port": 99999}}, r"master\.metrics_port: must be in \[0, 65535\], got 99999"),
        ({"workers": {"listen_port": 70000}}, r"workers\.listen_port: must be in \[0, 65535\], got 70000"),
        ({"workers": {"metrics_port": -1}}, r"workers\.metrics_port: must be in \[0, 65535\]"),
        ({"workers": {"addresses": ["worker-0"]}}, r"workers\.addresses\[0\]: must be HOST:PORT"),
        ({"workers": {"rendezvous": "host:0"}}, r"workers\.rendezvous: port must be in \[1, 65535\]"),
        ({"limits": {"request_timeout_s": -1}}, r"request_timeout_s: must be in \(0, 604800\] sec"),
        ({"workers": {"step_timeout_s": 0}}, r"workers\.step_timeout_s: must be in \(0, 604800\]"),
        ({"workers": {"join_timeout_s": -5}}, r"workers\.join_timeout_s: must be in \(0, 604800\]"),
        # Before: accepted, then torch's timedelta overflowed in the worker (a traceback), or no deadline.
        ({"workers": {"step_timeout_s": float("inf")}}, r"workers\.step_timeout_s: must be in .* got inf"),
        ({"workers": {"join_timeout_s": 1e15}}, r"workers\.join_timeout_s: must be in .* got 1e\+15"),
        ({"limits": {"request_timeout_s": float("inf")}}, r"limits\.request_timeout_s: must be in"),
        ({"decoding": {"seed": -1}}, r"decoding\.seed: must be in \[0, 2\^64\), got -1"),
        ({"decoding": {"seed": 2**64}}, r"decoding\.seed: must be in \[0, 2\^64\)"),
        # Before: accepted, then every request failed in the protobuf encoder ("Value out of range").
        ({"decoding": {"top_k": 2**32}}, r"decoding\.top_k: must be in \[0, 2\^32\), got 4294967296"),
        ({"tls": {"client_ca": "/ca.pem"}}, r"tls\.client_ca: client certificates need TLS"),
        ({"master": {"listen": "0.0.0.0:9090"}}, r"master: the ports of listen, metrics_port"),
        ({"model": {"path": ["a"]}}, r"model\.path: must be a string, got \['a'\]"),
        ({"master": {"model_name": True}}, r"master\.model_name: must be a string, got True"),
        ({"master": {"http_min_body_rate": 0}}, r"master\.http_min_body_rate: must be >= 1, got 0"),
        ({"master": {"http_max_connections_per_client": -1}},
         r"master\.http_max_connections_per_client: must be >= 0, got -1"),
        ({"master": {"grpc_max_connections": 0}}, r"master\.grpc_max_connections: must be >= 1, got 0"),
        ({"master": {"grpc_idle_timeout_s": 0}}, r"master\.grpc_idle_timeout_s: must be in \(0, 604800\]"),
        ({"limits": {"max_branches": 15.5}}, r"limits\.max_branches: must be an integer, got 15\.5"),
        ({"limits": {"max_branches": 65}}, r"limits\.max_branches: must be in \[1, 64\], got 65"),
        ({"limits": {"queue_size": 0}}, r"limits\.queue_size: must be >= 1, got 0"),
        ({"decoding": {"branches": True}}, r"decoding\.branches: must be an integer, got True"),
        ({"decoding": {"block_size": 8.5}}, r"decoding\.block_size: must be an integer, got 8\.5"),
        ({"decoding": {"tau_conf": False}}, r"decoding\.tau_conf: must be a number, got False"),
        ({"workers": {"count": "2"}}, r"workers\.count: must be an integer, got '2'"),
    ],
)
def test_config_values_are_checked_with_their_range(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


def test_config_accepts_device_indices_and_the_off_ports() -> None:
    config = parse_config({"model": {"device": "cuda:1"}, "workers": {"backend": "nccl", "listen_port": 0},
                           "master": {"listen": "[::]:50051", "metrics_port": 0}})
    assert config.model.device == "cuda:1" and config.master.metrics_port == 0
    assert parse_config({"limits": {"request_timeout_s": 5}}).limits.request_timeout_s == 5.0


def test_a_config_without_decoding_serves_with_the_models_own_defaults() -> None:
    from lopa.model.decoding_defaults import model_defaults
    from lopa.serving.shared.config import with_model_defaults
    from lopa.serving.shared.model_dir import model_path

    bundled = model_path("")
    model = model_defaults(bundled)
    assert model.block_size != DecodingParams().block_size  # the test needs a model with its own defaults
    assert with_model_defaults(parse_config({}), bundled).decoding == model
    partial = with_model_defaults(parse_config({"decoding": {"branches": 3, "tau_conf": 0.8}}), bundled)
    assert partial.decoding == model.with_overrides(branches=3, tau_conf=0.8)  # the file's keys win
    full = parse_config({"decoding": {"block_size": 16}})
    assert with_model_defaults(with_model_defaults(full, bundled), bundled).decoding.block_size == 16


def test_limits_are_checked_against_the_keys_that_will_be_served() -> None:
    """A limit below the paper's default is fine when the model's own default fits (before: a file
    with only limits.max_new_tokens 100 was refused over the paper's 256, which it never serves)."""
    from lopa.serving.shared.config import validate, with_model_defaults
    from lopa.serving.shared.model_dir import model_path

    config = with_model_defaults(parse_config({"limits": {"max_new_tokens": 100}}), model_path(""))
    validate(config)
    assert config.decoding.max_new_tokens == 32 <= config.limits.max_new_tokens
    # A limit below the model's default answer length caps that default (the file did not choose it).
    capped = with_model_defaults(parse_config({"limits": {"max_new_tokens": 24}}), model_path(""))
    validate(capped)
    assert capped.decoding.max_new_tokens == 24
    # One of block_size / max_new_tokens alone is checked against the model's other one, not the
    # paper's (max_new_tokens 16 alone is fine on the bundled model's block 8; before: refused vs 32).
    short = with_model_defaults(parse_config({"decoding": {"max_new_tokens": 16}}), model_path(""))
    validate(short)
    assert (short.decoding.block_size, short.decoding.max_new_tokens) == (8, 16)
    # A block wider than the default answer: one block is decoded, the answer is its first 32 tokens.
    wide = with_model_defaults(parse_config({"decoding": {"block_size": 64}}), model_path(""))
    validate(wide)
    assert (wide.decoding.block_size, wide.decoding.max_new_tokens) == (64, 32)


def test_a_file_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    path = tmp_path / "lopa.yaml"
    path.write_bytes(b"limits:\n  queue_size: \xff\xfe\n")
    with pytest.raises(ConfigError, match=rf"{path}: not UTF-8 text \(byte"):
        load_config(path)


def test_a_key_given_twice_is_refused(tmp_path: Path) -> None:
    """A duplicate key is an error naming it and its line, not the last value kept silently."""
    path = tmp_path / "lopa.yaml"
    path.write_text("decoding:\n  branches: 1\n  tau_conf: 0.8\n  branches: 3\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value).startswith(f"{path}: not valid YAML: duplicate key 'branches' (line 4)")


def test_yaml_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "lopa.yaml"
    path.write_text("decoding: [1,\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert f'in "{path}"' in str(error.value) and "<unicode string>" not in str(error.value)


def test_unknown_keys_list_the_known_ones_in_the_documented_order() -> None:
    with pytest.raises(ConfigError) as error:
        parse_config({"decoding": {"nope": 1}})
    known = ", ".join(f.name for f in dataclasses.fields(DecodingParams))
    assert str(error.value) == f"decoding.nope: unknown key (known: {known})"


def test_auto_backend_follows_the_device() -> None:
    """workers.backend auto takes the device's backend; several ranks sharing one GPU get gloo (nccl
    refuses them); a backend that is set is kept."""
    devices = ("cpu", "cuda", "cuda:1", "npu")
    assert [backend_for(AUTO, d) for d in devices] == ["gloo", "nccl", "nccl", "hccl"]
    assert backend_for(AUTO, "cuda", ranks_per_device=2) == "gloo"
    assert backend_for("gloo", "cuda") == "gloo"
    defaults = parse_config({})
    assert (defaults.model.device, defaults.workers.backend) == (AUTO, AUTO)


def test_a_set_backend_that_does_not_fit_the_device_auto_found_names_both() -> None:
    config = parse_config({"workers": {"backend": "nccl"}})  # fine until the device is known
    if resolve_device(AUTO) != "cpu":
        pytest.skip("this machine has an accelerator")
    with pytest.raises(ConfigError, match=r"workers\.backend: 'nccl' does not match model\.device 'cpu' "
                       r"\(use gloo\); model\.device auto found cpu on this machine"):
        device_choice.resolve(config)
    resolved = device_choice.resolve(parse_config({}), ranks_per_device=2)
    assert (resolved.model.device, resolved.workers.backend) == ("cpu", "gloo")
    line = device_choice.start_line(resolved, parse_config({}))
    assert line == ("device cpu (auto: no CUDA or NPU device found), dtype float32, "
                    "collective backend gloo (auto)")
