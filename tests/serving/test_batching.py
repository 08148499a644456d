"""The master batches concurrent requests over 1, 2 and 3 workers, and no output depends on its batch.

Real `lopa master` and `lopa worker` processes on the bundled model: 16 concurrent mixed requests
(prompts, lengths, k, stop strings, both attention modes, two sampled) answer, token for token, what
each answers alone on the local engine; cancelling one of 8 streams leaves the other 7 unchanged;
pinned branches and the branches granted per step travel over gRPC.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from lopa.engine import LocalEngine, bundled_model_dir
from lopa.scheduling.request import Completion
from lopa.serving.client import LopaClient
from lopa.serving.launcher import LocalCluster, loopback_config
from lopa.serving.ports import free_ports
from lopa.serving.shared.config import parse_config, with_model_defaults
from tests.helpers.mixed import MixedRequest, mixed_requests

from .conftest import metric_samples

REQUESTS = mixed_requests(16)


@pytest.fixture(scope="module")
def alone() -> list[Completion]:
    """Each request on its own, on the local engine (the reference every batched answer must equal)."""
    engine = LocalEngine(LocalEngine.from_dirs(bundled_model_dir()).loaded, max_batch=1)
    return [engine.generate(r.prompt, r.params, stop=r.stop) for r in REQUESTS]


def start_cluster(workers: int, work: Path, **limits: int) -> LocalCluster:
    raw = {"model": {"path": str(bundled_model_dir())},
           "limits": {"max_batch": 16, "max_step_tokens": 100_000, "queue_size": 32, **limits},
           "master": {"metrics_port": free_ports(1)[0]}}
    config = with_model_defaults(parse_config(raw), bundled_model_dir())
    cluster = LocalCluster(loopback_config(config, workers), work, log_dir=work)
    cluster.start(timeout=180)
    return cluster


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda w: f"{w}-workers")
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    cluster = start_cluster(request.param, tmp_path_factory.mktemp(f"batching-{request.param}"))
    try:
        with LopaClient(cluster.address) as client:
            yield request.param, client, cluster.config.master.metrics_port
    finally:
        cluster.stop()


def send(client: LopaClient, r: MixedRequest) -> object:
    return client.generate(r.prompt, timeout=300, stop=r.stop, **r.overrides())


def same(reply: object, reference: Completion) -> bool:
    stats = reply.stats
    return (reply.text, list(reply.token_ids), reply.finish_reason, stats.mean_branches,
            stats.verified_tokens) == (
        reference.text, reference.result.output_ids, reference.finish_reason,
        pytest.approx(reference.result.mean_branches), reference.result.verified_tokens)


def test_sixteen_concurrent_requests_equal_each_alone(served: tuple, alone: list[Completion]) -> None:
    """Every answer equals the local engine's lone one, the two sampled with a seed included: each
    candidate samples from its own stream of (seed, candidate), wherever it is verified."""
    workers, client, metrics_port = served
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        replies = list(pool.map(lambda r: send(client, r), REQUESTS))
    changed = [i for i, (reply, ref) in enumerate(zip(replies, alone, strict=True)) if not same(reply, ref)]
    assert not changed, f"{workers} workers: requests {changed} changed in a batch"
    assert {r.finish_reason for r in replies} >= {"stop", "eos"}
    # The gateway's view: rounds really were batched, every slot is free again. The scheduler
    # reports the freed slot before it answers, but a scrape is no snapshot of every gauge at one
    # instant: they are given a few seconds, not read once.
    gauges = ("lopa_requests_running", "lopa_kv_slot_usage", "lopa_queue_depth")
    deadline = time.monotonic() + 10
    samples = metric_samples(metrics_port)
    while any(samples[g] for g in gauges) and time.monotonic() < deadline:
        time.sleep(0.05)
        samples = metric_samples(metrics_port)
    assert samples["lopa_batch_size_sum"] / samples["lopa_batch_size_count"] > 2
    assert samples["lopa_requests_running"] == samples["lopa_kv_slot_usage"] == 0
    assert samples["lopa_queue_depth"] == 0 and samples["lopa_branches_granted_count"] > 0
    verified = sum(r.stats.verified_tokens for r in replies)  # > tokens: every branch row counts
    assert verified > sum(r.stats.tokens for r in replies)
    assert samples["lopa_verified_tokens_total"] >= verified  # earlier tests' requests count too


def test_cancelling_one_of_eight_streams_leaves_the_others_unchanged(
    served: tuple, alone: list[Completion]
) -> None:
    workers, client, _ = served
    if workers != 2:
        pytest.skip("one worker count is enough for cancellation")
    picked = [i for i, r in enumerate(REQUESTS) if r.params.branches > 0][:8]
    first_chunk = threading.Event()
    chunks: dict[int, list] = {i: [] for i in picked}

    def stream(i: int) -> object:
        r = REQUESTS[i]
        call = client.stream(r.prompt, timeout=300, stop=r.stop, **r.overrides())
        try:
            for chunk in call:
                chunks[i].append(chunk)
                if i == picked[0]:
                    first_chunk.set()
                    call.cancel()
            return "done"
        except grpc.RpcError as error:
            return error.code()

    with ThreadPoolExecutor(8) as pool:
        futures = {i: pool.submit(stream, i) for i in picked}
        assert first_chunk.wait(120)
        results = {i: f.result() for i, f in futures.items()}
    assert results[picked[0]] == grpc.StatusCode.CANCELLED
    for i in picked[1:]:
        assert results[i] == "done", (i, results[i])
        got = chunks[i]
        ref = alone[i]
        assert "".join(c.text for c in got) == ref.text, i
        assert [t for c in got for t in c.token_ids] == ref.result.output_ids, i
        assert [c.granted_branches for c in got if c.step] == list(ref.result.granted_branches), i
        assert got[-1].finish_reason == ref.finish_reason
    # The freed slot serves a new request as usual.
    assert same(send(client, REQUESTS[picked[0]]), alone[picked[0]])
