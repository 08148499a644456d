"""No slow client holds a port: slots are reclaimed, connections capped and timed out, scrapes served.

A real master + 1 worker of the tiny model, its ports bounded small so that the tests stay cheap on
a 2-core machine: the HTTP port at 200 connections (64 per client address, bodies due within 3 s),
the gRPC port at 100 (idle 3 s, handshake 2 s). The hostile clients (lopa_bench.attacks) run in
processes of their own. The full-size runs (1,100 slow bodies held 60 s against the default 1,024
slots, 5,000 HTTP/2 clients against the default cap and 75 s idle timeout) are `lopa bench edges`,
recorded in BENCHMARKS.md ("The master's edges").
"""

from __future__ import annotations

import contextlib
import os
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lopa.serving.client import LopaClient
from lopa.serving.launcher import LocalCluster, loopback_config
from lopa.serving.ports import free_ports
from lopa.serving.shared.config import parse_config
from lopa.serving.shared.metrics import METRICS_READ_TIMEOUT_S

from .conftest import attack, metric_samples, report

HTTP_SLOTS, PER_CLIENT, BODY_TIMEOUT_S = 200, 64, 3.0
GRPC_SLOTS, GRPC_IDLE_S, GRPC_HANDSHAKE_S = 100, 3.0, 2.0
ATTACKERS = [f"127.0.0.{i}" for i in range(2, 6)]  # 4 addresses: the per-client cap does not bind
MODEL = "serving-checkpoint0"


@pytest.fixture(scope="module")
def cluster(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    work = tmp_path_factory.mktemp("slow-clients")
    http, metrics = free_ports(2)
    raw = {
        "model": {"path": str(checkpoint)},
        "decoding": {"block_size": 8, "max_new_tokens": 16},
        "limits": {"max_new_tokens": 64, "max_prompt_tokens": 64},
        "master": {"http_port": http, "metrics_port": metrics, "http_max_connections": HTTP_SLOTS,
                   "http_max_connections_per_client": PER_CLIENT, "http_body_timeout_s": BODY_TIMEOUT_S,
                   "http_header_timeout_s": 2, "grpc_max_connections": GRPC_SLOTS,
                   "grpc_idle_timeout_s": GRPC_IDLE_S, "grpc_handshake_timeout_s": GRPC_HANDSHAKE_S},
        "workers": {"join_timeout_s": 60, "step_timeout_s": 20},
    }
    cluster = LocalCluster(loopback_config(parse_config(raw), workers=1), work, log_dir=work)
    cluster.start(timeout=120)
    yield cluster
    cluster.stop()


def refused(cluster: LocalCluster) -> dict[str, float]:
    """lopa_http_connections_refused_total by reason."""
    url = f"http://127.0.0.1:{cluster.config.master.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {s.labels["reason"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "lopa_http_connections_refused_total"}


def test_slow_bodies_give_their_slots_to_health_checks_and_completions(cluster: LocalCluster) -> None:
    """More slow bodies than slots, reopened as the server closes them, for two body timeouts: every
    /health and every completion succeeds meanwhile, and the refusal counter counts every
    connection the server evicted (or answered from its probe reserve)."""
    port = cluster.config.master.http_port
    before = sum(refused(cluster).values())
    log_lines = len(cluster.log_path("master").read_text().splitlines())
    seconds = 2.5 * BODY_TIMEOUT_S
    slow = attack("slow_bodies", port=port, count=HTTP_SLOTS + 20, seconds=seconds, sources=ATTACKERS)
    time.sleep(0.5)  # the slots are full
    health = attack("probe", url=f"http://127.0.0.1:{port}/health", seconds=seconds - 1, interval=0.1)
    completion = attack("probe", url=f"http://127.0.0.1:{port}/v1/completions", seconds=seconds - 1,
                        interval=0.3, body={"model": MODEL, "prompt": "hello", "max_tokens": 8})
    seen_health, seen_completion, flood = report(health), report(completion), report(slow)
    print(f"health {seen_health['statuses']}, completions {seen_completion['statuses']}, attackers {flood}")
    assert not seen_health["failures"] and set(seen_health["statuses"]) == {"200"}, seen_health
    assert not seen_completion["failures"] and set(seen_completion["statuses"]) == {"200"}, seen_completion
    assert flood["evicted"] > 0 and flood["opened"] > HTTP_SLOTS
    time.sleep(0.5)
    counted = sum(refused(cluster).values()) - before
    seen = flood["evicted"] + flood["answered"].get("503", 0)
    # Equal but for a connection its client had closed itself as the server evicted it.
    assert seen <= counted <= seen + 5, (counted, flood)
    added = cluster.log_path("master").read_text().splitlines()[log_lines:]
    assert not any("Traceback" in line or "HTTP 500" in line for line in added), added[:10]
    assert len(added) < 20, added[:20]


def test_one_client_address_holds_at_most_its_cap(cluster: LocalCluster) -> None:
    port = cluster.config.master.http_port
    flood = report(attack("slow_bodies", port=port, count=3 * PER_CLIENT, seconds=1.0, sources=["127.0.0.9"]))
    assert flood["evicted"] >= 2 * PER_CLIENT - 5, flood  # all but its cap's worth gave way at once
    assert refused(cluster).get("client_cap", 0) > 0


def open_sockets(pid: int) -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return count


def test_http2_clients_on_the_grpc_port_are_capped_and_closed_when_idle(cluster: LocalCluster) -> None:
    """Five times the cap of HTTP/2 connections that never call: the master's sockets stay under the
    cap plus a margin, and every connection is closed within the idle timeout (which gRPC spreads
    by up to 10%)."""
    assert cluster.master is not None
    pid, port = cluster.master.pid, int(cluster.address.rsplit(":", 1)[1])
    base = open_sockets(pid)
    clients = attack("http2", port=port, count=5 * GRPC_SLOTS, seconds=GRPC_IDLE_S + 6)
    most = base
    deadline = time.monotonic() + GRPC_IDLE_S + 1
    while time.monotonic() < deadline:
        most = max(most, open_sockets(pid))
        time.sleep(0.1)
    seen = report(clients)
    print(f"master sockets: {base} before, at most {most}; clients {seen}")
    assert most <= base + GRPC_SLOTS + 16, (base, most)
    assert seen["still_open"] == 0 and seen["closed_at_accept"] >= 4 * GRPC_SLOTS - 10, seen
    assert seen["longest_s"] <= 1.1 * GRPC_IDLE_S + 1, seen  # gRPC spreads its idle timer by 10%
    with LopaClient(cluster.address) as client:  # the port serves again
        assert client.health(timeout=10) == "SERVING"


def test_trickling_sockets_on_the_metrics_port_leave_scrapes_served(cluster: LocalCluster) -> None:
    """As many tricklers as the metrics server's slots, a byte each every half second: every scrape
    succeeds (it takes the oldest trickler's place), and no trickler outlives the total deadline
    of a request head."""
    port = cluster.config.master.metrics_port
    seconds = METRICS_READ_TIMEOUT_S + 2
    tricklers = attack("trickle", port=port, count=16, seconds=seconds, every=0.5)
    time.sleep(1.0)
    url = f"http://127.0.0.1:{port}/metrics"
    scrapes = report(attack("probe", url=url, seconds=seconds - 2, interval=1.0))
    trickled = report(tricklers)
    print(f"scrapes {scrapes['statuses']}, tricklers {trickled}")
    assert not scrapes["failures"] and set(scrapes["statuses"]) == {"200"}, scrapes
    assert trickled["cut"] >= 16 and trickled["longest_s"] <= METRICS_READ_TIMEOUT_S + 1, trickled
    assert metric_samples(port)["lopa_workers_joined"] == 1
