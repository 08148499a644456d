"""No request shape stalls the master: each is bounded in cost before it is parsed or expanded.

A real `lopa master` process (no workers: /health says 503, yet answers) of a model whose longest
token is 256 characters, as a 7B byte-level vocabulary's runs of spaces are, with 2,048-token
prompts: its HTTP body limit (6 x (2048 x 256 + 64 x 1024) + 64 KiB = 3.6 MB) lets the 3.2 MB
batch of 800,000 one-character prompts in, to be refused by the bound on its JSON values. Four
copies of each shape are sent at once while another process polls /health every 20 ms.

Recorded on the 2-core CPU machine (BENCHMARKS.md, "The master's edges"): every copy refused;
/health's p99 a few ms, and the master's peak memory up by tens of MB at most.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator

import pytest

from lopa.serving.ports import free_ports
from lopa.serving.shared.config import load_config
from lopa_bench.edges import wide_checkpoint

from .conftest import attack, master_process, report, reset_peak, rss_mb, write_config


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int, str]]:
    """(the master's pid, its HTTP port, its gRPC address)."""
    work = tmp_path_factory.mktemp("costs")
    checkpoint = wide_checkpoint(work / "wide")
    (http,) = free_ports(1)
    config = write_config(work, checkpoint, 1, limits={"max_prompt_tokens": 2048, "max_new_tokens": 1024,
                                                       "queue_size": 64}, master={"http_port": http})
    with master_process(config, work / "master.log", f"http://127.0.0.1:{http}/health") as process:
        yield process.pid, http, load_config(config).master.listen


def test_four_copies_of_each_stalling_shape_are_refused_while_health_answers(
    master: tuple[int, int, str],
) -> None:
    pid, http, listen = master
    reset_peak(pid)
    before = rss_mb(pid)
    health = attack("probe", url=f"http://127.0.0.1:{http}/health", seconds=600, interval=0.02)
    sent = report(attack("shapes", http_port=http, grpc_address=listen, model="wide", copies=4,
                         batch_prompts=800_000, grpc_bytes=[15_900_000, 2_300_000], gzip_bytes=2_000_000))
    health.send_signal(signal.SIGTERM)
    seen = report(health)
    grown = rss_mb(pid, "VmHWM") - before
    answers = {name: shape["answers"] for name, shape in sent.items()}
    expected = {
        "batch of 800000 prompts (3.2 MB)": "413 body: more than 20480 JSON values",
        "gzip bomb (2.0 MB)": "415 body: Content-Encoding 'gzip' is not accepted",
        "gRPC unknown fields (15.9 MB)": "RESOURCE_EXHAUSTED",  # over the message limit, 2.4 MB
        "gRPC unknown fields (2.3 MB)": "INVALID_ARGUMENT request: cannot be parsed",
    }
    for name, start in expected.items():
        assert len(answers[name]) == 4 and all(a.startswith(start) for a in answers[name]), answers
    latencies = sorted(seen["latencies"])
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    print(f"/health: {len(latencies)} answers, p99 {p99 * 1000:.1f} ms, slowest {latencies[-1] * 1000:.1f} "
          f"ms; peak memory +{grown:.1f} MB; shapes: {json.dumps(sent)}")
    assert not seen["failures"] and seen["statuses"] == {"503": len(latencies)}, seen["failures"][:3]
    assert p99 < 0.1, p99
    assert grown < 50, grown
