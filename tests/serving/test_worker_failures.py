"""A failure inside one request's share of a step fails that request, not the worker group:
the worker answers with the error instead of leaving, the master fails the
request with INTERNAL and keeps the group; a device fault still takes the worker out."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from lopa.execution.shard import ShardExecutor
from lopa.model.loader import load_model
from lopa.params import DecodingParams
from lopa.proto import worker_pb2
from lopa.scheduling.request import SchedulerStopped
from lopa.serving.master.api.grpc_service import status_of
from lopa.serving.master.failures import failure_of
from lopa.serving.master.group.distributed import DistributedExecutor, StepFailed
from lopa.serving.master.group.links import WorkerLink, WorkerLost
from lopa.serving.ports import free_ports
from lopa.serving.shared.config import load_config
from lopa.serving.worker.service import WorkerService, start_server

from .conftest import start_workers, stop, write_config


def step_request(begin: bool) -> worker_pb2.StepRequest:
    request = worker_pb2.StepRequest()
    step = request.parts.add(sequence=0, start=0, n_stage=0)
    if begin:
        begin = worker_pb2.Begin(attention="full", conf="neg_entropy", top_p=1.0, num_rows=1)
        step.begin.CopyFrom(begin)
    step.windows.add(tokens=[5, 6, 7, 100, 100], block_ids=[0, 0, 0, 1, 1], masked=[3, 4])
    return request


@pytest.fixture
def service(checkpoint: Path) -> tuple[WorkerService, list[int]]:
    loaded = load_model(checkpoint)
    fatal: list[int] = []
    service = WorkerService(0, 1, loaded.config.vocab_size, 64, fatal.append)
    service.ready(None, ShardExecutor(loaded.window_model(64), 0, lambda buf, src: None))  # type: ignore[arg-type]
    return service, fatal


def test_a_failed_forward_is_answered_and_the_next_request_runs(
    service: tuple[WorkerService, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, fatal = service
    assert worker.shard is not None

    def out_of_memory(*args: Any) -> None:
        raise RuntimeError("out of memory: tried to allocate 80 GiB")

    with monkeypatch.context() as patch:
        patch.setattr(worker.shard, "verify_round", out_of_memory)
        reply = worker.step(step_request(begin=True))
    assert reply.error == "RuntimeError: out of memory: tried to allocate 80 GiB" and not reply.parts
    assert not fatal  # the worker stays in its group
    reply = worker.step(step_request(begin=True))  # the next request begins clean
    assert not reply.error and len(reply.parts[0].branches) == 1
    assert len(reply.parts[0].branches[0].tokens) == 2


def test_a_bad_begin_is_answered_too(service: tuple[WorkerService, list[int]]) -> None:
    worker, fatal = service
    request = step_request(begin=True)
    request.parts[0].begin.conf = "no-such-conf"
    reply = worker.step(request)
    assert reply.parts[0].error.startswith("InvalidParameter: conf: must be one of") and not fatal


def test_a_device_fault_still_leaves_the_group(
    service: tuple[WorkerService, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, _ = service
    assert worker.shard is not None

    def illegal_access(*args: Any) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(worker.shard, "verify_round", illegal_access)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        worker.step(step_request(begin=True))


class _Link:
    """One worker's end of the step stream, answering with a canned reply."""

    def __init__(self, reply: worker_pb2.StepReply) -> None:
        self.reply, self.sent = reply, []

    def send(self, request: worker_pb2.StepRequest) -> None:
        self.sent.append(request)

    def receive(self, timeout: float) -> worker_pb2.StepReply:
        return self.reply


class _Group:
    def __init__(self, links: list[Any]) -> None:
        self.links, self.attached, self.losses, self.leaves = links, True, [], []

    def lost(self, rank: int, reason: str, leave: bool = True) -> None:
        self.losses.append(reason)
        self.leaves.append(leave)


def test_the_master_fails_the_request_and_keeps_the_group() -> None:
    from lopa.decoding.executor import BranchWindow, VerifyPart, verify_part

    stats = worker_pb2.BranchStats(tokens=[1], probs=[0.5], confs=[-1.0])
    ok = worker_pb2.StepReply(parts=[worker_pb2.PartStats(branches=[stats])])
    failed = worker_pb2.StepReply(error="RuntimeError: out of memory")
    group = _Group([_Link(ok), _Link(failed)])
    executor = DistributedExecutor(group, step_timeout_s=5)  # type: ignore[arg-type]
    executor.begin(DecodingParams(branches=1), 2)
    windows = [BranchWindow([5, 100], [0, 1], [1]), BranchWindow([5, 100], [0, 1], [1])]
    with pytest.raises(StepFailed, match="worker rank 1: RuntimeError: out of memory"):
        verify_part(executor, VerifyPart(0, 0, 0, windows))
    assert group.attached and not group.losses
    assert status_of(StepFailed("x")) is grpc.StatusCode.INTERNAL
    # A request the stopping master did not finish may be retried elsewhere (not CANCELLED).
    stopped = SchedulerStopped("stopping")
    assert status_of(stopped) is grpc.StatusCode.UNAVAILABLE
    assert failure_of(stopped).kind.label == "unavailable"


class _CancelledLink(_Link):
    """A rank whose stream the master cancelled because another rank's loss detached the group."""

    def __init__(self, group: _Group) -> None:
        super().__init__(worker_pb2.StepReply())
        self.group = group

    def receive(self, timeout: float) -> worker_pb2.StepReply:
        self.group.attached = False
        self.group.detach_reason = "lost worker rank 1: worker rank 1 (127.0.0.1:2) stream ended"
        raise WorkerLost("worker rank 0 (127.0.0.1:1): CANCELLED: Locally cancelled by application!")


def test_a_lost_group_is_reported_by_its_cause_not_by_the_cancelled_rank() -> None:
    """After a SIGKILL of rank 1 the error names rank 1's lost stream, not rank 0 cancelled."""
    from lopa.decoding.executor import BranchWindow, VerifyPart, verify_part

    group = _Group([])
    group.links = [_CancelledLink(group), _Link(worker_pb2.StepReply())]
    group.detach_reason = ""
    executor = DistributedExecutor(group, step_timeout_s=5)  # type: ignore[arg-type]
    executor.begin(DecodingParams(), 1)
    with pytest.raises(WorkerLost) as error:
        verify_part(executor, VerifyPart(0, 0, 0, [BranchWindow([5, 100], [0, 1], [1])]))
    assert str(error.value) == "lost worker rank 1: worker rank 1 (127.0.0.1:2) stream ended"


def test_a_worker_busy_with_another_master_is_never_told_to_leave(
    service: tuple[WorkerService, list[int]],
) -> None:
    """A worker refuses a second master's stream (ABORTED); a round that meets that refusal drops
    this master's group without sending Leave, which would end the first master's healthy group."""
    from lopa.decoding.executor import BranchWindow, VerifyPart, verify_part

    worker, _ = service
    address = f"127.0.0.1:{free_ports(1)[0]}"
    server = start_server(worker, address)
    first, second = WorkerLink(0, address), WorkerLink(0, address)
    try:
        first.open(_Group([first]))  # type: ignore[arg-type]
        deadline = time.monotonic() + 10
        while not worker.master_attached and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.master_attached
        group = _Group([second])
        second.open(group)  # type: ignore[arg-type]
        executor = DistributedExecutor(group, step_timeout_s=5)  # type: ignore[arg-type]
        executor.begin(DecodingParams(), 1)
        with pytest.raises(WorkerLost, match="ABORTED") as error:
            verify_part(executor, VerifyPart(0, 0, 0, [BranchWindow([5, 100], [0, 1], [1])]))
        assert error.value.busy
        assert group.leaves and not any(group.leaves)  # the round's drop and the stream's end alike
    finally:
        first.close()
        second.close()
        server.stop(None)


def test_a_malformed_reply_drops_the_group() -> None:
    """A reply with the wrong number of branches fails the round UNAVAILABLE and drops the group (the
    worker and the master disagree on the round); before, the group was kept for the next round."""
    from lopa.decoding.executor import BranchWindow, VerifyPart, verify_part

    stats = worker_pb2.BranchStats(tokens=[1], probs=[0.5], confs=[-1.0])
    two = worker_pb2.StepReply(parts=[worker_pb2.PartStats(branches=[stats, stats])])
    group = _Group([_Link(two)])
    executor = DistributedExecutor(group, step_timeout_s=5)  # type: ignore[arg-type]
    executor.begin(DecodingParams(), 1)
    with pytest.raises(WorkerLost, match="answered 2 of 1 branches"):
        verify_part(executor, VerifyPart(0, 0, 0, [BranchWindow([5, 100], [0, 1], [1])]))
    assert group.losses and group.leaves == [True]


def test_a_failed_commit_leaves_the_group_at_once(checkpoint: Path, tmp_logs: Path) -> None:
    """Rank 0 wins a commit it cannot pack (a ValueError before its broadcast) while rank 1 waits in
    that broadcast. Before: rank 0 answered INVALID_ARGUMENT ("malformed step, the group is intact")
    and stayed; rank 1 waited out the step timeout (20 s). Now rank 0 answers INTERNAL and both leave
    the broken group in seconds, even with no master telling them to (the stand-in group sends no
    Leave)."""
    config = write_config(tmp_logs, checkpoint, workers=2)
    procs = start_workers(config, 2, tmp_logs)
    addresses = load_config(config).workers.addresses
    links = [WorkerLink(rank, address) for rank, address in enumerate(addresses)]
    try:
        deadline = time.monotonic() + 90
        while not all(joined(link) for link in links):
            assert time.monotonic() < deadline, "the workers did not join"
            time.sleep(0.2)
        group = _Group(links)
        for link in links:
            link.open(group)  # type: ignore[arg-type]
        # Sequence 1 never began: rank 0 cannot pack its winner's K/V.
        commit = worker_pb2.Commit(sequence=1, n=1, winner_rank=0, winner_slot=0, broadcast=True)
        for link in links:
            link.send(worker_pb2.StepRequest(commits=[commit]))
        with pytest.raises(WorkerLost, match="INTERNAL: rank 0: step failed: commit failed"):
            links[0].receive(timeout=30)
        assert procs[0].wait(timeout=10) == 3
        assert procs[1].wait(timeout=10) == 3  # its broadcast failed with its peer gone
    finally:
        for link in links:
            link.close()
        stop(procs)


def joined(link: WorkerLink) -> bool:
    try:
        return link.info(timeout=1.0).joined
    except grpc.RpcError:
        return False
