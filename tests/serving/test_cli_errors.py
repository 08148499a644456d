"""Every way a new user can hold the CLI wrong ends in one line naming the flag or config key, not a
traceback: `lopa client`, `lopa serve`, `lopa master`, `lopa worker`, `lopa generate`, `lopa bench tpf`."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from lopa.cli import build_parser, main, serve
from lopa.model.decoding_defaults import model_defaults
from lopa.proto import lopa_pb2
from lopa.serving.launcher import LocalCluster, describe_exits
from lopa.serving.ports import free_ports
from lopa.serving.shared.config import parse_config
from lopa.serving.shared.model_dir import model_path

from .conftest import worker_env, write_config


@pytest.fixture(autouse=True)
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """In this process a check that came too late fails the test instead of starting a server or a load."""
    import lopa.cli.generate
    import lopa.cli.master
    import lopa.serving.worker.service
    import lopa_bench.cli

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("started: the error should have come first")

    monkeypatch.setattr(lopa.cli.master, "_serve_until_signalled", started)
    monkeypatch.setattr(lopa.serving.worker.service, "serve_worker", started)
    monkeypatch.setattr(LocalCluster, "start", started)
    monkeypatch.setattr(lopa.cli.generate.LocalEngine, "from_dirs", started)
    monkeypatch.setattr(lopa_bench.cli.LocalEngine, "from_dirs", started)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """(exit code, stderr) of `lopa argv...` run in this process."""
    try:
        code = main(list(argv))
    except SystemExit as exited:
        code = exited.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err


def one_line(err: str) -> str:
    assert err.endswith("\n") and err.count("\n") == 1, err
    return err.strip()


def closed_address() -> str:
    return f"127.0.0.1:{free_ports(1)[0]}"


# -- lopa client ----------------------------------------------------------------------------------------


def test_the_commands_that_hold_no_model_start_without_torch() -> None:
    """`lopa client` runs to its end, and `serve`, `master` and `fetch-model` parse their flags,
    without importing torch (seconds of start-up and hundreds of MB per process); the master's
    server and the launcher load none either (the master's tokenizer, from transformers, does)."""
    script = (
        "import sys\n"
        "import lopa.serving.launcher, lopa.serving.master.server\n"
        "from lopa.cli import build_parser, main\n"
        "for command in ('serve', 'master', 'fetch-model'):\n"
        "    build_parser(command)\n"
        "try:\n"
        f"    code = main(['client', 'info', '--address', {closed_address()!r}])\n"
        "except SystemExit as exited:\n"
        "    code = exited.code\n"
        "print(code, [m for m in sys.modules if m.split('.')[0] == 'torch'][:3])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env=worker_env())
    assert done.stdout.split() == ["1", "[]"], done.stdout + done.stderr  # 1: the closed port's error
    assert "UNAVAILABLE" in done.stderr, done.stderr



@pytest.mark.parametrize(
    ("flag", "value", "reason"),
    [
        ("--branches", "-1", "must be >= 0, got -1"),
        ("--seed", "-1", "must be >= 0, got -1"),
        ("--top-k", "-1", "must be >= 0, got -1"),
        # The bound named is the one the server applies (>= 1, > 0): 0 is refused before sending.
        ("--max-new-tokens", "-5", "must be >= 1, got -5"),
        ("--max-new-tokens", "0", "must be >= 1, got 0"),
        ("--block-size", "0", "must be >= 1, got 0"),
        ("--timeout", "0", "must be > 0 (seconds), got 0.0"),
        ("--timeout", "-1", "must be > 0 (seconds), got -1.0"),
    ],
)
def test_client_generate_rejects_bad_counts_before_sending(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, reason: str
) -> None:
    address = closed_address()  # nothing listens: the request must not get as far as sending
    code, err = run_cli(capsys, "client", "generate", "--address", address, "--prompt", "x", flag, value)
    assert code == 2
    assert one_line(err) == f"lopa client: error: {flag}: {reason}"


def test_client_info_reports_an_unreachable_master_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(capsys, "client", "info", "--address", closed_address())
    assert code == 1 and one_line(err).startswith("lopa client: error: UNAVAILABLE: ")


def test_client_info_has_the_tls_flags(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, err = run_cli(capsys, "client", "info", "--ca", str(tmp_path / "missing.pem"))
    assert code == 2
    assert one_line(err) == f"lopa client: error: --ca: no such file: {tmp_path / 'missing.pem'}"
    (tmp_path / "client.pem").write_text("")
    code, err = run_cli(capsys, "client", "info", "--cert", str(tmp_path / "client.pem"))
    assert code == 2 and one_line(err) == "lopa client: error: --key: --cert and --key go together"


def test_lopa_bench_without_its_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lopa_bench", None)  # as if only lopa were installed
    monkeypatch.delitem(sys.modules, "lopa_bench.cli", raising=False)
    with pytest.raises(SystemExit) as stopped:
        main(["bench", "tpf", "--out", "x"])
    assert str(stopped.value).startswith("lopa bench: error: its package lopa_bench")
    assert "pip install ./runtime" in str(stopped.value)


def test_lopa_help_names_every_bench(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # unwrapped
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    benches = capsys.readouterr().out.split("{", 1)[1].split("}", 1)[0]  # usage: lopa bench [-h] {tpf,...}
    assert f"benchmarks: {benches.replace(',', ', ')}" in text


def test_lopa_version_names_lopa_and_torch(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    import lopa

    out = capsys.readouterr().out.strip()
    assert out.startswith(f"lopa {lopa.__version__} (torch {torch.__version__.split('+')[0]}"), out


def test_client_generate_help_explains_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["client", "generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # unwrapped
    for flag, help_text in [
        ("--address ADDRESS", "the master's client API, HOST:PORT (default: 127.0.0.1:50051)"),
        ("--prompt PROMPT", "prompt text"),
        ("--chat", "apply the model's chat template"),
        ("--stop STOP", "stop sequence (repeatable)"),
        ("--max-new-tokens MAX_NEW_TOKENS", "generation budget (default: the server's"),
        ("--json", "print one JSON object"),
        ("--ca CA", "CA bundle"),
    ]:
        assert f"{flag} {help_text}" in text, flag
    assert "decoding overrides (default: the server's" in text


# -- lopa serve -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--prompt", ""], "lopa serve: error: --prompt: is empty"),
        (["--listen", "bogus"], "lopa serve: error: --listen: must be HOST:PORT, got 'bogus'"),
        (["--metrics-port", "99999"], "lopa serve: error: --metrics-port: must be in [0, 65535], got 99999"),
        (["--workers", "0"], "lopa serve: error: --workers: must be >= 1, got 0"),
        (["--start-timeout", "nan"],
         "lopa serve: error: --start-timeout: must be in (0, 604800] seconds, got nan"),
        (["--max-batch", "0"], "lopa serve: error: --max-batch: must be in [1, 256], got 0"),
        (["--http-port", "70000"], "lopa serve: error: --http-port: must be in [0, 65535], got 70000"),
        (["--max-step-tokens", "-5"],
         "lopa serve: error: --max-step-tokens: must be >= 0 (0 = the device's default), got -5"),
    ],
)
def test_serve_checks_its_flags_before_starting_anything(
    capsys: pytest.CaptureFixture[str], argv: list[str], line: str
) -> None:
    code, err = run_cli(capsys, "serve", "--listen", closed_address(), *argv)
    assert code == 2 and one_line(err) == line


def test_serve_names_a_malformed_port_range(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    listen = closed_address()
    monkeypatch.setenv("LOPA_PORT_RANGE", "30000")
    code, err = run_cli(capsys, "serve", "--listen", listen)
    assert code == 2
    bounds = "must be LOW-HIGH with 1 <= LOW <= HIGH <= 65535"
    assert one_line(err) == f"lopa serve: error: LOPA_PORT_RANGE: {bounds}, got '30000'"


@pytest.mark.parametrize("flag", ["--http-port", "--metrics-port"])
def test_serve_names_the_flag_of_a_port_in_use_or_taken_twice(
    capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    """Before, the master found the port busy and the user read its config key (master.http_port).
    The ports listen on the host of --listen (loopback by default)."""
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        listen = closed_address()
        code, err = run_cli(capsys, "serve", "--listen", listen, flag, str(port))
    assert code == 2
    host = listen.rsplit(":", 1)[0]
    assert one_line(err).startswith(f"lopa serve: error: {flag}: cannot listen on {host}:{port}: ")
    listen = closed_address()
    same = listen.rsplit(":", 1)[1]
    code, err = run_cli(capsys, "serve", "--listen", listen, flag, same)
    assert code == 2
    assert one_line(err) == f"lopa serve: error: {flag}: must differ from --listen (both {same})"
    free = closed_address().rsplit(":", 1)[1]
    code, err = run_cli(capsys, "serve", "--listen", listen, "--http-port", free, "--metrics-port", free)
    assert code == 2
    assert one_line(err) == f"lopa serve: error: --metrics-port: must differ from --http-port (both {free})"


def test_serve_with_a_config_file_without_decoding_uses_the_models_defaults(tmp_path: Path) -> None:
    """Not the paper's (block 32, 256 tokens): on the bundled model every request would fail."""
    config = tmp_path / "lopa.yaml"
    config.write_text(yaml.safe_dump({"limits": {"queue_size": 8}}))
    args = build_parser().parse_args(["serve", "--config", str(config), "--listen", closed_address()])
    assert serve.serving_config(args).decoding == model_defaults(model_path(""))
    args = build_parser().parse_args(["serve", "--config", str(config), "--branches", "3"])
    assert serve.serving_config(args).decoding == model_defaults(model_path("")).with_overrides(branches=3)
    args = build_parser().parse_args(["serve", "--config", str(config), "--http-port", "8123",
                                      "--max-batch", "4", "--max-step-tokens", "300"])
    served = serve.serving_config(args)
    assert (served.master.http_port, served.limits.max_batch, served.limits.max_step_tokens) == (8123, 4, 300)


def test_serve_names_logs_that_cannot_be_a_directory(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Before, a missing --logs directory failed as "[Errno 2] ... worker-0.log", naming no flag."""
    a_file = tmp_path / "file"
    a_file.write_text("")
    code, err = run_cli(capsys, "serve", "--logs", str(a_file), "--listen", closed_address())
    assert code == 2 and one_line(err) == f"lopa serve: error: --logs: {a_file} exists and is not a directory"
    below = a_file / "below"
    code, err = run_cli(capsys, "serve", "--logs", str(below), "--listen", closed_address())
    assert code == 2 and one_line(err).startswith(f"lopa serve: error: --logs: cannot create {below}: ")
    created = tmp_path / "new" / "logs"
    args = build_parser().parse_args(["serve", "--logs", str(created), "--listen", closed_address()])
    serve.check_flags(args)
    assert created.is_dir()


def test_serve_refuses_a_budget_below_one_block(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(capsys, "serve", "--max-step-tokens", "7", "--listen", closed_address())
    assert code == 1
    assert one_line(err) == ("lopa serve: error: limits.max_step_tokens: 7 tokens cannot hold one request's "
                             "base row (decoding.block_size 8); set 0 (the device's default) or >= 8")


def test_serve_keeps_the_files_http_port_and_replaces_its_metrics_port(tmp_path: Path) -> None:
    """As `lopa serve --help` says: --http-port wins when given, else the file's master.http_port;
    master.metrics_port is --metrics-port's (0 without it)."""
    config = tmp_path / "lopa.yaml"
    config.write_text(yaml.safe_dump({"master": {"http_port": 18123, "metrics_port": 19191}}))
    args = build_parser().parse_args(["serve", "--config", str(config)])
    served = serve.serving_config(args)
    assert (served.master.http_port, served.master.metrics_port) == (18123, 0)
    args = build_parser().parse_args(["serve", "--config", str(config), "--http-port", "18124",
                                      "--metrics-port", "19192"])
    served = serve.serving_config(args)
    assert (served.master.http_port, served.master.metrics_port) == (18124, 19192)


def test_serve_takes_the_worker_count_of_its_config_file(tmp_path: Path) -> None:
    """--workers defaults to the file's workers.count (before: always 2, the file's count ignored)."""
    config = tmp_path / "lopa.yaml"
    addresses = [f"127.0.0.1:{port}" for port in (50061, 50062, 50063)]
    config.write_text(yaml.safe_dump({"workers": {"count": 3, "addresses": addresses}}))
    args = build_parser().parse_args(["serve", "--config", str(config), "--listen", closed_address()])
    assert serve.serving_config(args).workers.count == 3
    args = build_parser().parse_args(["serve", "--config", str(config), "--workers", "1"])
    assert serve.serving_config(args).workers.count == 1
    assert serve.serving_config(build_parser().parse_args(["serve"])).workers.count == 2


def test_serve_passes_the_weights_flag_over_the_files_key(tmp_path: Path) -> None:
    config = tmp_path / "lopa.yaml"
    config.write_text(yaml.safe_dump({"model": {"weights": "fp8"}}))
    args = build_parser().parse_args(["serve", "--config", str(config), "--listen", closed_address()])
    assert serve.serving_config(args).model.weights == "fp8"  # the file's, reaching the workers' config
    args = build_parser().parse_args(["serve", "--config", str(config), "--weights", "dtype"])
    assert serve.serving_config(args).model.weights == "dtype"
    assert serve.serving_config(build_parser().parse_args(["serve"])).model.weights == "dtype"


def _a_gpu_without_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine's torch sees a GPU of compute capability 8.0 (an A100) at cuda:0."""
    from lopa.cli import preflight, worker

    monkeypatch.setattr(preflight, "_index_problem", lambda *args: None)
    monkeypatch.setattr(worker, "device_problem", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")


NO_FP8 = "fp8 weights need a GPU of compute capability 8.9 or more; NVIDIA A100-SXM4-80GB has 8.0 (use dtype)"


def test_a_worker_on_a_gpu_without_fp8_refuses_fp8_weights_naming_the_key(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, checkpoint: Path
) -> None:
    path = write_config(tmp_path, checkpoint, workers=1)
    raw = yaml.safe_load(path.read_text())
    raw["model"].update(device="cuda", weights="fp8")
    raw["workers"]["backend"] = "nccl"
    path.write_text(yaml.safe_dump(raw))
    _a_gpu_without_fp8(monkeypatch)
    code, err = run_cli(capsys, "worker", "--config", str(path), "--rank", "0")
    assert code == 1 and one_line(err) == f"lopa worker: error: {path}: model.weights: {NO_FP8}"


def test_generate_refuses_fp8_weights_on_a_gpu_without_fp8(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _a_gpu_without_fp8(monkeypatch)
    code, err = run_cli(capsys, "generate", "--prompt", "x", "--device", "cuda", "--weights", "fp8")
    assert code == 2 and one_line(err) == f"lopa generate: error: --weights: {NO_FP8}"


def test_generate_refuses_a_bad_max_length(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(capsys, "generate", "--prompt", "x", "--max-length", "-5")
    assert code == 2 and one_line(err) == "lopa generate: error: --max-length: must be >= 1, got -5"


def test_a_certificate_that_does_not_parse_is_named(tmp_path: Path) -> None:
    """Before: gRPC took the bytes, then the bind failed as 'master.listen: ... already in use'."""
    from lopa.serving.shared.config import ConfigError, TlsConfig
    from lopa.serving.shared.tls import server_credentials

    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    key.write_text("garbage")
    with pytest.raises(ConfigError, match=r"tls\.cert / tls\.key: not a PEM certificate and its private key"):
        server_credentials(TlsConfig(cert=str(cert), key=str(key)))


def test_a_metrics_port_in_use_names_its_key() -> None:
    from prometheus_client import CollectorRegistry

    from lopa.serving.shared.metrics import serve_registry

    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(OSError, match=rf"workers\.metrics_port: cannot listen on port {port}: "):
            serve_registry(CollectorRegistry(), port, "workers.metrics_port")


def test_a_metrics_port_serves_metrics_at_metrics_only() -> None:
    import urllib.error
    import urllib.request

    from prometheus_client import CollectorRegistry, Counter

    from lopa.serving.shared.metrics import serve_registry

    registry = CollectorRegistry()
    Counter("lopa_probe_total", "a sample", registry=registry).inc()
    (port,) = free_ports(1)
    serve_registry(registry, port, "master.metrics_port", "127.0.0.1")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        assert "lopa_probe_total 1.0" in reply.read().decode()
    for path in ("/", "/anything", "/v1/completions"):
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5)
        assert error.value.code == 404, path


def test_supervise_reports_a_dead_master() -> None:
    cluster = LocalCluster.__new__(LocalCluster)  # no config file, no children: just the supervisor
    cluster.master, cluster.workers = subprocess.Popen(["sleep", "60"]), []
    cluster.master.kill()
    with pytest.raises(RuntimeError, match=r"^the master exited \(killed by SIGKILL\); stopping the workers"):
        cluster.supervise(poll_s=0.05)


def test_a_worker_that_exits_cleanly_before_the_group_forms_fails_the_start() -> None:
    """Before, an exit code of 0 was not a failure: the start waited its whole timeout (600 s)."""
    cluster = LocalCluster.__new__(LocalCluster)  # no config file: just the wait, on a closed address
    cluster.config = parse_config({"master": {"listen": closed_address()}})
    cluster.log_dir = None
    cluster.master, cluster.workers = subprocess.Popen(["sleep", "60"]), [subprocess.Popen(["true"])]
    cluster.workers[0].wait()
    began = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"^worker\(s\) exited before the group formed: rank 0 exited"):
            cluster.wait_serving(60, strict=True)
    finally:
        cluster.master.kill()
    assert time.monotonic() - began < 30


def test_worker_exits_are_described_in_words() -> None:
    assert describe_exits([(0, 3), (1, -9)]) == "rank 0 exited with code 3, rank 1 killed by SIGKILL"


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_serve_stops_the_workers_and_fails_when_its_master_dies(checkpoint: Path) -> None:
    if not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists():
        pytest.skip("needs /proc/PID/task/PID/children to find the master")
    command = [sys.executable, "-m", "lopa", "serve", "--workers", "1", "--model", str(checkpoint),
               "--block-size", "8", "--max-new-tokens", "16", "--listen", closed_address(),
               "--start-timeout", "120"]
    served = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=worker_env())
    try:
        assert "serving on" in served.stdout.readline()
        children = _children(served.pid)
        master = [c for c in children if b"master" in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert len(master) == 1 and len(children) == 2, children
        os.kill(master[0], signal.SIGKILL)
        _, err = served.communicate(timeout=60)
    finally:
        served.kill()
    assert served.returncode == 1, err[-3000:]
    assert "lopa serve: error: the master exited (killed by SIGKILL); stopping the workers" in err
    deadline = time.monotonic() + 10
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(c) for c in children)


def test_serve_killed_outright_leaves_no_process_and_no_temp_folder(checkpoint: Path, tmp_path: Path) -> None:
    """SIGKILL of `lopa serve` takes its master and workers down too and frees the port."""
    if not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists():
        pytest.skip("needs /proc/PID/task/PID/children to find the children")
    temp = tmp_path / "tmp"
    temp.mkdir()
    listen = closed_address()
    command = [sys.executable, "-m", "lopa", "serve", "--workers", "2", "--model", str(checkpoint),
               "--block-size", "8", "--max-new-tokens", "16", "--listen", listen, "--start-timeout", "120"]
    served = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              env={**worker_env(), "TMPDIR": str(temp)})
    try:
        assert "serving on" in served.stdout.readline()
        children = _children(served.pid)
        assert len(children) == 3 and [p.name[:11] for p in temp.iterdir()] == ["lopa-serve-"]
        served.kill()
        served.wait(timeout=10)
        deadline = time.monotonic() + 5
        while (any(_alive(c) for c in children) or any(temp.iterdir())) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(c) for c in children), "children outlived lopa serve"
        assert not any(temp.iterdir()), "the temporary config folder leaked"
        host, port = listen.rsplit(":", 1)
        with socket.socket() as again:
            again.bind((host, int(port)))  # the port is free for the next `lopa serve`
    finally:
        served.kill()
        for child in _children(served.pid):
            os.kill(child, signal.SIGKILL)


def test_serve_with_logs_reports_why_a_child_failed_and_where(checkpoint: Path, tmp_path: Path) -> None:
    """With --logs DIR a broken model's failure names the child, its exit code and its log's last line."""
    model, logs = tmp_path / "model", tmp_path / "logs"
    shutil.copytree(checkpoint, model)
    logs.mkdir()
    tensors = load_file(model / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, model / "model.safetensors")
    command = [sys.executable, "-m", "lopa", "serve", "--workers", "1", "--model", str(model),
               "--logs", str(logs), "--block-size", "8", "--max-new-tokens", "16",
               "--listen", closed_address(), "--prompt", "x"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=worker_env())
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    exited = "lopa serve: error: worker(s) exited before the group formed: rank 0 exited with code 1; "
    assert last.startswith(exited), done.stderr[-2000:]
    assert f"{logs / 'worker-0.log'} ends: lopa worker: error: " in last
    assert "missing tensor model.layers.1.mlp.down_proj.weight" in last


# -- lopa master / lopa worker: config files ------------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "values", "key"),
    [
        ("model", {"dtype": "float8"}, "model.dtype"),
        ("model", {"weights": "int4"}, "model.weights: must be one of dtype, fp8, got 'int4'"),
        ("model", {"device": "tpu"}, "model.device"),
        ("model", {"device": "npu"}, "workers.backend: 'gloo' does not match model.device 'npu'"),
        ("master", {"listen": "not-an-address"}, "master.listen"),
        ("master", {"metrics_port": 99999}, "master.metrics_port"),
        ("limits", {"max_batch": 0}, "limits.max_batch: must be in [1, 256], got 0"),
        ("limits", {"max_batch": 257}, "limits.max_batch: must be in [1, 256], got 257"),
        ("limits", {"max_step_tokens": -1}, "limits.max_step_tokens: must be >= 0"),
        # Below one block no round holds two requests: batching would be off without a word.
        ("limits", {"max_step_tokens": 4}, "limits.max_step_tokens: 4 tokens cannot hold one request's"),
    ],
)
@pytest.mark.parametrize("command", [["master"], ["worker", "--rank", "0"]])
def test_master_and_worker_refuse_a_bad_config_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, checkpoint: Path,
    section: str, values: dict, key: str, command: list[str],
) -> None:
    path = write_config(tmp_path, checkpoint, workers=1)
    raw = yaml.safe_load(path.read_text())
    raw[section].update(values)
    path.write_text(yaml.safe_dump(raw))
    code, err = run_cli(capsys, command[0], "--config", str(path), *command[1:])
    assert code == 1 and one_line(err).startswith(f"lopa {command[0]}: error: {path}: {key}")


LONGER_THAN_THE_MODEL = (
    "decoding.max_new_tokens: 512 leaves no room for a prompt in the model's length 256 "
    "(max_position_embeddings 256 in "
)


@pytest.mark.parametrize("command", [["master"], ["worker", "--rank", "0"]])
def test_master_and_worker_refuse_a_default_answer_longer_than_the_model(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: list[str]
) -> None:
    """A default answer longer than the model would fail every request without its own
    max_new_tokens, naming a value the client never sent: the file is refused at start instead,
    naming the key."""
    path = tmp_path / "lopa.yaml"
    path.write_text(yaml.safe_dump({
        "decoding": {"max_new_tokens": 512}, "limits": {"max_new_tokens": 512},
        "workers": {"count": 1, "addresses": ["127.0.0.1:1"]},
    }))
    code, err = run_cli(capsys, command[0], "--config", str(path), *command[1:])
    assert code == 1 and "at most 255" in err
    assert one_line(err).startswith(f"lopa {command[0]}: error: {path}: {LONGER_THAN_THE_MODEL}")


def test_serve_refuses_a_default_answer_longer_than_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(capsys, "serve", "--listen", closed_address(), "--max-new-tokens", "512")
    assert code == 1 and one_line(err).startswith(f"lopa serve: error: {LONGER_THAN_THE_MODEL}")


def test_a_bad_lopa_defaults_json_is_named_by_generate_master_and_worker(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, checkpoint: Path
) -> None:
    """A bad lopa_defaults.json is named by generate, master and worker alike (not a flag nobody
    passed, such as --block-size)."""
    model = tmp_path / "model"
    shutil.copytree(checkpoint, model)
    (model / "lopa_defaults.json").write_text('{"block_size": 0}')
    expected = f"{model / 'lopa_defaults.json'}: block_size: must be >= 1, got 0"
    code, err = run_cli(capsys, "generate", "--model", str(model), "--prompt", "x")
    assert code == 1 and one_line(err) == f"lopa generate: error: {expected}"
    path = write_config(tmp_path, model, workers=1)
    for command in (["master"], ["worker", "--rank", "0"]):
        code, err = run_cli(capsys, command[0], "--config", str(path), *command[1:])
        assert code == 1 and one_line(err) == f"lopa {command[0]}: error: {expected}"


def test_worker_rank_errors_name_the_flag(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(write_config(tmp_path, checkpoint, workers=1))
    code, err = run_cli(capsys, "worker", "--config", path, "--rank", "5")
    assert code == 2 and one_line(err) == "lopa worker: error: --rank: 5 outside [0, workers.count=1)"
    monkeypatch.setenv("LOPA_RANK", "abc")
    code, err = run_cli(capsys, "worker", "--config", path)
    assert code == 2
    assert one_line(err) == "lopa worker: error: --rank: $LOPA_RANK must be an integer, got 'abc'"


def test_master_reports_an_address_it_cannot_listen_on(tmp_path: Path, checkpoint: Path) -> None:
    config = write_config(tmp_path, checkpoint, workers=1, master={"listen": "192.0.2.1:50051"})  # TEST-NET
    command = [sys.executable, "-m", "lopa", "master", "--config", str(config)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=worker_env())
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.splitlines()[-1]
    assert last.startswith("lopa master: error: master.listen: cannot listen on 192.0.2.1:50051: ")
    assert "Traceback" not in done.stderr


def test_master_without_decoding_in_its_config_serves_the_models_defaults(tmp_path: Path) -> None:
    """`lopa master` on the bundled model, no workers: `lopa client info` shows the model's defaults."""
    listen = closed_address()
    worker, rendezvous = free_ports(2)
    config = tmp_path / "lopa.yaml"
    config.write_text(yaml.safe_dump({
        "master": {"listen": listen, "metrics_port": 0},
        "workers": {"addresses": [f"127.0.0.1:{worker}"], "rendezvous": f"127.0.0.1:{rendezvous}"},
    }))
    master = subprocess.Popen([sys.executable, "-m", "lopa", "master", "--config", str(config)],
                              stderr=subprocess.PIPE, text=True, env=worker_env())
    try:
        for line in master.stderr:
            if "master listening" in line:
                break
        info = subprocess.run([sys.executable, "-m", "lopa", "client", "info", "--address", listen],
                              capture_output=True, text=True, timeout=60, env=worker_env())
    finally:
        master.send_signal(signal.SIGTERM)
        master.communicate(timeout=30)
    assert info.returncode == 0, info.stderr
    defaults = model_defaults(model_path(""))
    assert f"block_size: {defaults.block_size}" in info.stdout
    assert f"tau_conf: {defaults.tau_conf}" in info.stdout
    assert "health: NOT_SERVING" in info.stdout  # no workers: the group is not ready
    if "default_max_new_tokens" in lopa_pb2.ModelInfo.DESCRIPTOR.fields_by_name:
        assert f"default_max_new_tokens: {defaults.max_new_tokens}" in info.stdout


# -- lopa generate / lopa bench tpf --------------------------------------------------------------------


def test_generate_reports_an_unusable_device_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(capsys, "generate", "--prompt", "x", "--device", "foo")
    assert code == 2
    assert one_line(err) == ("lopa generate: error: --device: must be cpu, cuda[:N], npu[:N] or auto, "
                             "got 'foo'")
    if not torch.cuda.is_available():
        code, err = run_cli(capsys, "generate", "--prompt", "x", "--device", "cuda")
        assert code == 2 and one_line(err) == (
            "lopa generate: error: --device: 'cuda': no CUDA device is available on this machine"
        )
    if importlib.util.find_spec("torch_npu") is None:
        code, err = run_cli(capsys, "generate", "--prompt", "x", "--device", "npu")
        assert code == 2 and "--device: 'npu' needs the torch-npu package" in one_line(err)


def test_generate_help_states_each_default_once(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(paper: 32" not in text and text.count("(paper default: 32)") == 1


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--ks", "0,x"], "--ks: each k must be an integer in [0, 64], got 'x'"),
        (["--ks", "99"], "--ks: each k must be an integer in [0, 64], got '99'"),
        (["--ks", ","], "--ks: needs at least one comma-separated value"),
        (["--modes", "foo"], "--modes: each mode must be one of full, block_causal, got 'foo'"),
        (["--threads", "0"], "--threads: must be >= 1, got 0"),
        (["--limit", "0"], "--limit: must be >= 1, got 0"),
    ],
)
def test_bench_tpf_flags_name_themselves(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], line: str
) -> None:
    code, err = run_cli(capsys, "bench", "tpf", "--out", str(tmp_path), *argv)
    assert code == 2 and one_line(err) == f"lopa bench: error: {line}"
