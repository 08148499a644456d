"""`lopa bench edges`: the master's edges under hostile clients, at full size.

Each row is one attack (lopa_bench.attacks, in processes of their own) against real processes, with
what the master's other clients saw meanwhile:

- shapes: four copies at once of each stalling request shape, against a master alone whose body
  limit is a 7B model's (a tiny model of 2,048-token prompts whose tokenizer has a 256-character
  token): /health's latencies, the master's peak memory growth, every copy's answer;
- slow bodies: `--slow` connections sending a request head and one body byte, held, then reopened
  as the master closes them, for `--hold` s each, from 8 addresses, against a master and a worker
  of the bundled model with the default HTTP bounds: /health and completions meanwhile, and the
  master's refusal counter against the evictions the attackers saw;
- http2: `--http2` HTTP/2 connections that never call, on the gRPC port's default cap and idle
  timeout: the master's open sockets, when each connection was closed;
- metrics: 16 connections trickling a metrics request a byte every 5 s, for 30 s: the scrapes
  meanwhile, and how long a trickler lasted.

    lopa bench edges [--slow 1100] [--hold 60] [--http2 5000] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lopa.params import InvalidParameter
from lopa_bench.attacks import collect, spawn, stop_probe
from lopa_bench.rows import check_json, finish, percentile, show_row

SOURCES = [f"127.0.0.{i}" for i in range(2, 10)]  # the slow bodies' addresses (8)
LONGEST_TOKEN = 256


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser(
        "edges",
        help="the master's edges under hostile clients (request shapes, slow bodies, HTTP/2, metrics)",
        description="Attack a real master at full size; report what /health, completions and scrapes saw.",
    )
    parser.add_argument("--slow", type=int, default=1100, help="slow-body connections (default: %(default)s)")
    parser.add_argument("--hold", type=float, default=60.0, help="seconds the slow bodies are held")
    parser.add_argument("--http2", type=int, default=5000, help="HTTP/2 clients on the gRPC port")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    for name in ("slow", "http2"):
        if getattr(args, name) < 1:
            raise InvalidParameter(name, f"must be >= 1, got {getattr(args, name)}")
    if not args.hold > 0:
        raise InvalidParameter("hold", f"must be > 0 seconds, got {args.hold}")
    check_json(args.json)
    rows = []
    with tempfile.TemporaryDirectory(prefix="lopa-edges-") as tmp:
        rows.append(shapes(Path(tmp)))
        show_row(rows[-1])
        with bundled_group(Path(tmp) / "group") as cluster:
            for measure in (slow_bodies_held, slow_bodies_reopened, http2_clients, tricklers):
                rows.append(measure(cluster, args))
                show_row(rows[-1])
    finish(rows, args.json)
    return 0


def answered(seen: dict[str, Any], ok: str) -> str:
    """A probe's report: how many of its requests got `ok` (a status), of how many."""
    return f"{seen['statuses'].get(ok, 0)}/{len(seen['latencies'])} {ok}"


def row(attack: str, refused: str, probe: str, seen: dict[str, Any] | None, ok: str = "200",
        completions: str = "", master: str = "") -> dict[str, Any]:
    """One table row: the attack, what the attackers got, what a probe saw meanwhile (answers, p99
    and slowest latency), completions meanwhile, what the master showed."""
    measured: dict[str, Any] = {"probe": "", "probe p99 ms": "", "probe slowest ms": ""}
    if seen:
        latencies = seen["latencies"]
        failures = ", ".join(sorted(set(seen["failures"])))
        measured = {"probe": f"{probe} {answered(seen, ok)}" + (f" ({failures})" if failures else ""),
                    "probe p99 ms": round(1000 * percentile(latencies, 99), 1),
                    "probe slowest ms": round(1000 * max(latencies, default=0.0), 1)}
    return {"attack": attack, "attackers got": refused, **measured, "completions": completions,
            "master": master}


# -- shapes ---------------------------------------------------------------------------------------------


def shapes(work: Path) -> dict[str, Any]:
    from lopa.serving.ports import free_ports
    from lopa.serving.shared.config import dump_config, parse_config

    model = wide_checkpoint(work / "wide")
    http, listen, rendezvous, worker = free_ports(4)
    raw = {"model": {"path": str(model)}, "decoding": {"block_size": 8, "max_new_tokens": 32},
           "limits": {"max_prompt_tokens": 2048, "max_new_tokens": 1024},
           "master": {"listen": f"127.0.0.1:{listen}", "metrics_port": 0, "http_port": http},
           "workers": {"addresses": [f"127.0.0.1:{worker}"], "rendezvous": f"127.0.0.1:{rendezvous}"}}
    config = work / "wide.yaml"
    config.write_text(dump_config(parse_config(raw)))
    with lone_master(config, work / "master.log", f"http://127.0.0.1:{http}/health") as pid:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM: the peak from now on
        before = memory_mb(pid, "VmRSS")
        health = spawn("probe", url=f"http://127.0.0.1:{http}/health", seconds=600, interval=0.02)
        sent = collect(spawn("shapes", http_port=http, grpc_address=f"127.0.0.1:{listen}", model="wide",
                             copies=4, batch_prompts=800_000, grpc_bytes=[15_900_000, 2_300_000],
                             gzip_bytes=2_000_000))
        seen = stop_probe(health)
        grown = memory_mb(pid, "VmHWM") - before
    answers = "; ".join(f"{name}: {len(shape['answers'])} x {shape['answers'][0].split(':')[0][:24]}"
                        for name, shape in sent.items())
    return row("4 copies of each stalling shape", answers, "/health", seen, ok="503",
               master=f"peak memory +{grown:.1f} MB")


def wide_checkpoint(directory: Path) -> Path:
    """A tiny model of 4,096 positions whose tokenizer has a 256-character token (a 7B byte-level
    vocabulary's longest runs): the body and message limits of a 7B model."""
    from lopa.synthetic import tiny_config, write_random_checkpoint

    write_random_checkpoint(directory, tiny_config(max_position_embeddings=4096), seed=3)
    path = directory / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    tokenizer["added_tokens"].append({"id": 102, "content": "~" * LONGEST_TOKEN, "single_word": False,
                                      "lstrip": False, "rstrip": False, "normalized": False, "special": True})
    path.write_text(json.dumps(tokenizer))
    return directory


@contextlib.contextmanager
def lone_master(config: Path, log: Path, ready_url: str) -> Iterator[int]:
    """`lopa master` without workers (it answers, NOT_SERVING), yielded as its pid once up."""
    with log.open("wb") as sink:
        process = subprocess.Popen([sys.executable, "-m", "lopa", "master", "--config", str(config)],
                                   stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(ready_url, timeout=2)
                break
            except urllib.error.HTTPError:
                break  # 503: it answers
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the master did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.2)
        yield process.pid
    finally:
        process.terminate()
        process.wait(timeout=60)


def memory_mb(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key} for process {pid}")


# -- the connection attacks, on a bundled group ---------------------------------------------------------


@contextlib.contextmanager
def bundled_group(work: Path) -> Iterator[Any]:
    """A master and one worker of the bundled model, HTTP and metrics on, every bound at its default."""
    from lopa.bundled import bundled_model_dir
    from lopa.serving.launcher import LocalCluster, loopback_config
    from lopa.serving.ports import free_ports
    from lopa.serving.shared.config import parse_config, with_model_defaults

    http, metrics = free_ports(2)
    raw = {"model": {"path": str(bundled_model_dir())},
           "master": {"http_port": http, "metrics_port": metrics}}
    config = loopback_config(with_model_defaults(parse_config(raw), bundled_model_dir()), workers=1)
    cluster = LocalCluster(config, work, log_dir=work)
    cluster.start(timeout=300)
    try:
        yield cluster
    finally:
        cluster.stop()


def refused(cluster: Any) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    url = f"http://127.0.0.1:{cluster.config.master.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {s.labels["reason"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "lopa_http_connections_refused_total"}


def slow_bodies(cluster: Any, args: argparse.Namespace, reopen: bool) -> dict[str, Any]:
    port, hold = cluster.config.master.http_port, args.hold
    before = sum(refused(cluster).values())
    slow = spawn("slow_bodies", port=port, count=args.slow, seconds=hold, sources=SOURCES, reopen=reopen)
    time.sleep(1.0)
    health = spawn("probe", url=f"http://127.0.0.1:{port}/health", seconds=hold - 2, interval=0.1)
    completion = spawn("probe", url=f"http://127.0.0.1:{port}/v1/completions", seconds=hold - 2, interval=1.0,
                       body={"model": "lopa-bundled", "prompt": "head:ab=", "max_tokens": 8})
    seen_health, seen_completion, flood = collect(health), collect(completion), collect(slow)
    time.sleep(1.0)
    counted = int(sum(refused(cluster).values()) - before)
    late = ", ".join(f"{n} x {status}" for status, n in flood["answered"].items())
    got = f"{flood['opened']} opened, {flood['evicted']} evicted" + (f", {late}" if late else "")
    done = seen_completion["latencies"]
    completions = (f"{answered(seen_completion, '200')}, p99 {1000 * percentile(done, 99):.0f} ms")
    how = "reopened as closed" if reopen else "held"
    return row(f"{args.slow} slow bodies {how}, {hold:g} s", got, "/health", seen_health,
               completions=completions, master=f"refusal counter +{counted}")


def slow_bodies_held(cluster: Any, args: argparse.Namespace) -> dict[str, Any]:
    return slow_bodies(cluster, args, reopen=False)


def slow_bodies_reopened(cluster: Any, args: argparse.Namespace) -> dict[str, Any]:
    return slow_bodies(cluster, args, reopen=True)


def http2_clients(cluster: Any, args: argparse.Namespace) -> dict[str, Any]:
    master = cluster.config.master
    pid, port = cluster.master.pid, int(master.listen.rsplit(":", 1)[1])
    deadline = time.monotonic() + 60  # the HTTP attacks' connections closed first
    while open_sockets(pid) > 64 and time.monotonic() < deadline:
        time.sleep(0.5)
    base = open_sockets(pid)
    clients = spawn("http2", port=port, count=args.http2, seconds=master.grpc_idle_timeout_s + 15)
    most = base
    while clients.poll() is None:
        most = max(most, open_sockets(pid))
        time.sleep(0.2)
    seen = collect(clients)
    got = (f"{seen['closed_at_accept']} closed at accept, {seen['closed_later']} after at most "
           f"{seen['longest_s']} s, {seen['still_open']} left open")
    return row(f"{args.http2} HTTP/2 clients on the gRPC port", got, "", None,
               master=f"sockets {base} -> at most {most} (cap {master.grpc_max_connections}, idle timeout "
                      f"{master.grpc_idle_timeout_s:g} s)")


def open_sockets(pid: int) -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return count


def tricklers(cluster: Any, args: argparse.Namespace) -> dict[str, Any]:
    port, seconds = cluster.config.master.metrics_port, 30.0
    trickle = spawn("trickle", port=port, count=16, seconds=seconds, every=5.0)
    time.sleep(1.0)
    url = f"http://127.0.0.1:{port}/metrics"
    scrapes = collect(spawn("probe", url=url, seconds=seconds - 2, interval=1.0))
    cut = collect(trickle)
    return row("16 tricklers on /metrics (a byte / 5 s), 30 s",
               f"cut {cut['cut']} times, the longest lived {cut['longest_s']} s", "/metrics", scrapes)
