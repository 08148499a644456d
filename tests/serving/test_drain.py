"""Graceful drain: SIGTERM to a group's processes, as a pod deletion sends it.

The master stops admitting (health NOT_SERVING, new requests UNAVAILABLE naming the shutdown),
finishes every request queued or running, then exits; the workers keep serving its steps until it
went quiet. Nothing in flight is lost.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from lopa.bundled import tasks
from lopa.engine import LocalEngine, bundled_model_dir
from lopa.model.decoding_defaults import model_defaults
from lopa.serving.client import LopaClient
from lopa.serving.launcher import LocalCluster, loopback_config
from lopa.serving.ports import free_ports
from lopa.serving.shared.config import parse_config, with_model_defaults
from lopa.serving.worker.service import QUIET_S, Drain

from .conftest import wait_for_gauges

PROMPTS = [e.prompt for e in tasks.held_out(10)]


def test_sigterm_drains_every_request_in_flight_then_exits(tmp_path: Path) -> None:
    raw = {"model": {"path": str(bundled_model_dir())},
           "limits": {"max_batch": 4, "queue_size": 16, "request_timeout_s": 60,
                      "max_step_tokens": 100_000},  # every branch granted: outputs as alone
           "master": {"metrics_port": free_ports(1)[0]}}
    config = loopback_config(with_model_defaults(parse_config(raw), bundled_model_dir()), workers=2)
    engine = LocalEngine.from_dirs(bundled_model_dir(), max_batch=1)
    params = model_defaults(bundled_model_dir()).with_overrides(branches=3)
    expected = [engine.generate(p, params).text for p in PROMPTS]
    cluster = LocalCluster(config, tmp_path, log_dir=tmp_path)
    cluster.start(timeout=180)
    try:
        with LopaClient(cluster.address) as client, ThreadPoolExecutor(10) as pool:
            futures = [pool.submit(client.generate, p, 120, branches=3) for p in PROMPTS]
            # A batch decoding, more waiting, and every request received (else a request still on
            # its way is refused by the drain, as any new one is).
            wait_for_gauges(cluster, running=4, queued=1, arrived=len(PROMPTS))
            signalled = time.monotonic()
            for process in [cluster.master, *cluster.workers]:
                process.send_signal(signal.SIGTERM)
            try:
                client.generate(PROMPTS[0], timeout=10)
                raise AssertionError("a request was admitted while draining")
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.UNAVAILABLE, error
                assert "shutting down" in error.details() or error.details().startswith("failed to connect")
            answers = [f.result().text for f in futures]
        assert answers == expected  # every request in flight completed, unchanged
        assert cluster.master.wait(timeout=30) == 0
        assert [w.wait(timeout=15) for w in cluster.workers] == [0, 0]
        assert time.monotonic() - signalled < 30
        assert "drained" in (tmp_path / "master.log").read_text()
    finally:
        cluster.stop()



def test_a_draining_worker_serves_its_attached_master_and_leaves_once_it_is_gone() -> None:
    drain = Drain()
    now = time.monotonic()
    assert drain.done(now - 100, 300, attached=False) == ""  # no SIGTERM yet: serve on
    drain.request()
    assert drain.done(now, 300, attached=True) == ""  # the master still steps: keep serving
    assert drain.done(now, 300, attached=False) == "no master attached"  # its stream ended
    # Idle before SIGTERM: its master may still admit (in its preStop sleep), so it waits from SIGTERM.
    assert drain.done(now - 100, 300, attached=True) == ""
    drain.began = now - QUIET_S
    assert drain.done(now - 100, 300, attached=True) == "no step for 7 s"  # attached but idle
    drain.began = now - 300 - QUIET_S
    assert drain.done(now, 300, attached=True) == "the longest a request may last passed"


def test_workers_deleted_with_their_master_serve_it_through_its_pre_stop_sleep(
    checkpoint: Path, tmp_path: Path
) -> None:
    """A rollout deletes the workers and the master together: the workers get SIGTERM at once, the
    master only after its preStop sleep (5 s), admitting meanwhile. Before, idle workers left 0.2 s
    after SIGTERM (their last step was over 2 s old) and the master refused those requests
    UNAVAILABLE for the rest of its preStop."""
    raw = {"model": {"path": str(checkpoint)}, "decoding": {"block_size": 8, "max_new_tokens": 16},
           "limits": {"request_timeout_s": 30},
           "master": {"metrics_port": 0}}  # not the default 9090: another process may hold it (CI did)
    cluster = LocalCluster(loopback_config(parse_config(raw), workers=2), tmp_path, log_dir=tmp_path)
    cluster.start(timeout=120)
    try:
        with LopaClient(cluster.address) as client:
            client.generate([5, 17, 23], timeout=30)
            time.sleep(2.5)  # idle for longer than the old quiet period
            for worker in cluster.workers:
                worker.send_signal(signal.SIGTERM)
            time.sleep(3.0)  # the master, still in its preStop sleep, admits
            assert client.generate([5, 17, 23], timeout=30).stats.forwards > 0
            assert all(w.poll() is None for w in cluster.workers)
            assert cluster.master is not None
            cluster.master.send_signal(signal.SIGTERM)  # its preStop sleep is over: it drains
            assert cluster.master.wait(timeout=30) == 0
        assert [w.wait(timeout=15) for w in cluster.workers] == [0, 0]  # no master attached: they leave
    finally:
        cluster.stop()


def test_the_quiet_period_outlasts_the_masters_pre_stop_sleep() -> None:
    """The operator's pod contract: the workers outwait the master's preStop sleep, and the grace
    period's margin covers their quiet period."""
    from lopa_operator.pods import DRAIN_MARGIN_S, PRE_STOP_SLEEP_S

    assert PRE_STOP_SLEEP_S < QUIET_S < DRAIN_MARGIN_S
