"""Serving fixtures: a tiny checkpoint, free loopback ports, worker groups as real subprocesses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save_file

from lopa.decoding.decoder import Decoder
from lopa.model.families import family_named
from lopa.model.loader import load_model
from lopa.serving.launcher import LocalCluster
from lopa.serving.master.group.distributed import DistributedExecutor
from lopa.serving.master.group.links import WorkerGroup
from lopa.serving.ports import free_ports
from lopa.serving.shared.config import ServingConfig, dump_config, load_config, parse_config
from lopa.synthetic import tiny_config, write_random_checkpoint
from lopa_bench.attacks import collect, spawn

REPO = Path(__file__).resolve().parents[2]
torch.set_num_threads(1)  # tiny models; the CI box has 2 cores shared with the worker processes


def sharpened_checkpoint(directory: Path, family: str) -> Path:
    """A tiny random model of `family` with a sharpened head: confident distributions, so branch
    scores are not float-noise ties (a near-uniform random model makes winners depend on the last
    ulp)."""
    config = tiny_config(family=family)
    weights = write_random_checkpoint(directory, config, seed=3)
    head = family_named(family).checkpoint_name("lm_head.weight")
    weights[head] = weights[head] * 8.0
    save_file(weights, str(directory / "model.safetensors"))
    return directory


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharpened_checkpoint(tmp_path_factory.mktemp("serving-checkpoint"), "dream")


@pytest.fixture(scope="session")
def llada_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same, in the LLaDA format (own-position logits, no q/k/v bias)."""
    return sharpened_checkpoint(tmp_path_factory.mktemp("serving-llada-checkpoint"), "llada")


def write_config(
    directory: Path, checkpoint: Path, workers: int, backend: str = "gloo", **sections: dict
) -> Path:
    ports = free_ports(workers + 3)
    raw = {
        "model": {"path": str(checkpoint), "dtype": "float32", "device": "cpu"},
        "decoding": {"block_size": 8, "max_new_tokens": 32, "branches": 0},
        "limits": {"max_branches": 8, "max_new_tokens": 64, "max_prompt_tokens": 64, "queue_size": 4},
        "master": {"listen": f"127.0.0.1:{ports[0]}", "metrics_port": 0},
        "workers": {
            "count": workers,
            "addresses": [f"127.0.0.1:{p}" for p in ports[2 : 2 + workers]],
            "listen_port": 0,
            "metrics_port": 0,
            "backend": backend,
            "rendezvous": f"127.0.0.1:{ports[1]}",
            "join_timeout_s": 60,
            "step_timeout_s": 20,
        },
    }
    for name, values in sections.items():
        raw[name].update(values)
    path = directory / f"lopa-{workers}.yaml"
    path.write_text(dump_config(parse_config(raw)))
    return path


@contextmanager
def bundled_http_group(work: Path, limits: dict) -> Iterator[tuple[LocalCluster, int]]:
    """A master + 2 workers of the bundled model, its HTTP API and metrics on free ports:
    (the cluster, the HTTP port)."""
    from lopa.bundled import bundled_model_dir
    from lopa.serving.launcher import loopback_config
    from lopa.serving.shared.config import with_model_defaults


    def on_free_ports() -> ServingConfig:  # again when another test process took a port meanwhile
        port, metrics = free_ports(2)
        raw = {"model": {"path": str(bundled_model_dir())}, "limits": limits,
               "master": {"metrics_port": metrics, "http_port": port}}
        return loopback_config(with_model_defaults(parse_config(raw), bundled_model_dir()), workers=2)

    cluster = LocalCluster(on_free_ports(), work, log_dir=work)
    cluster.start_on_free_ports(on_free_ports, timeout=180)
    try:
        yield cluster, cluster.config.master.http_port
    finally:
        cluster.stop()


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    inherited = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO / "runtime") + (os.pathsep + inherited if inherited else "")
    env.setdefault("OMP_NUM_THREADS", "1")  # the CI box has 2 cores shared by every process
    return env


@contextmanager
def lopa_serve(*args: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """`lopa serve args...` until it prints its serving line: (the process, that line). On leaving,
    a process still running gets Ctrl-C (SIGINT) and a minute to stop, then is killed."""
    command = [sys.executable, "-m", "lopa", "serve", *args, "--start-timeout", "120"]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    serve = subprocess.Popen(command, **pipes, text=True, env=worker_env())
    try:
        line = serve.stdout.readline()  # the "serving on" line, or "" once it gave up
        assert line.startswith("lopa: serving on"), serve.communicate(timeout=30)[1][-3000:]
        yield serve, line
        if serve.poll() is None:
            serve.send_signal(signal.SIGINT)
            serve.communicate(timeout=60)
    finally:
        serve.kill()


def start_workers(config: Path, count: int, log_dir: Path) -> list[subprocess.Popen]:
    procs = []
    for rank in range(count):
        log = open(log_dir / f"worker-{rank}.log", "ab")  # noqa: SIM115 (lives as long as the process)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "lopa", "worker", "--config", str(config), "--rank", str(rank)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=worker_env(),
            )
        )
    return procs


@contextmanager
def distributed_decoder(
    config_path: Path, checkpoint: Path, log_dir: Path, join_s: float = 90, step_timeout_s: float = 20
) -> Iterator[Decoder]:
    """A Decoder over a DistributedExecutor whose workers (real subprocesses) joined their group;
    workers and links are stopped on exit."""
    config = load_config(config_path)
    procs = start_workers(config_path, config.workers.count, log_dir)
    group = WorkerGroup(config.workers.addresses, probe_interval_s=0.2)
    group.start()
    try:
        assert group.wait_attached(join_s), "workers did not join"
        special = load_model(checkpoint).special
        executor = DistributedExecutor(group, step_timeout_s=step_timeout_s)
        yield Decoder(executor, special.mask, special.eos, group.max_length)
    finally:
        group.stop()
        stop(procs)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


@pytest.fixture
def tmp_logs(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    for log in sorted(tmp_path.glob("*.log")):
        text = log.read_text(errors="replace")
        if "Traceback" in text:
            print(f"--- {log.name} ---\n{text[-3000:]}")


def metric_samples(port: int) -> dict[str, float]:
    """The master's /metrics on this port, sample name -> value (unlabelled samples)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def wait_for_gauges(
    cluster: LocalCluster, running: int, queued: int = 0, arrived: int = 0, admitted: int = 0
) -> None:
    """Until the master's own gauges show this many requests decoding and waiting, `arrived`
    requests received in all (admitted so far, finished ones included, plus waiting) and `admitted`
    of them past the queue. A fault injected after a fixed sleep instead found every request
    already answered on a fast machine (CI); one injected when only the gauges were met found a
    request still on its way from the client, refused by the drain it was meant to survive.

    `arrived` is counted as the admitted of the previous scrape plus the waiting of this one: a
    lower bound. One scrape's admitted + waiting can count a request admitted meanwhile twice (a
    scrape reads lopa_queue_depth before lopa_queue_seconds, so the depth may predate an admission
    that the count already includes), and so could report all arrived while one is still on its
    way."""
    port, deadline = cluster.config.master.metrics_port, time.monotonic() + 30
    admitted_before = 0.0  # lopa_queue_seconds_count of the previous scrape
    while True:
        samples = metric_samples(port)
        if (
            samples["lopa_requests_running"] >= running
            and samples["lopa_queue_depth"] >= queued
            and admitted_before + samples["lopa_queue_depth"] >= arrived
            and samples["lopa_queue_seconds_count"] >= admitted
        ):
            return
        assert time.monotonic() < deadline, (
            f"never saw {running} running, {queued} queued, {arrived} arrived, {admitted} admitted: {samples}"
        )
        admitted_before = samples["lopa_queue_seconds_count"]
        time.sleep(0.01)


@contextmanager
def master_process(config: Path, log: Path, ready_url: str) -> Iterator[subprocess.Popen]:
    """`lopa master --config` as a process of its own (no workers: its health says NOT_SERVING, yet
    it answers), yielded once `ready_url` answers; stopped on exit."""
    with log.open("wb") as sink:
        process = subprocess.Popen([sys.executable, "-m", "lopa", "master", "--config", str(config)],
                                   stdout=sink, stderr=subprocess.STDOUT, env=worker_env())
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(ready_url, timeout=2)
                break
            except urllib.error.HTTPError:
                break  # answered (503 without workers)
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
        yield process
    finally:
        stop([process])


def attack(kind: str, **arguments: object) -> subprocess.Popen:
    """A hostile client of lopa_bench.attacks in a process of its own (its JSON report: `report`)."""
    return spawn(kind, env=worker_env(), **arguments)


def report(process: subprocess.Popen, timeout: float = 300) -> dict:
    return collect(process, timeout)


def rss_mb(pid: int, key: str = "VmRSS") -> float:
    """A process's resident memory (VmRSS) or its peak since reset_peak (VmHWM), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {key} for process {pid}")


def reset_peak(pid: int) -> None:
    """From now on VmHWM is the peak since this call (Linux: clear_refs 5)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
