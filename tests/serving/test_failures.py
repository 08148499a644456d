"""Every failure kind of lopa.serving.master.failures through both client APIs: the HTTP answer
(status, OpenAI type, param, Retry-After) and the gRPC status of a real call (code, message, retry
pushback) are the table's row, and no message carries a worker's address or an internal error's
details. (The paths that raise each of them are tested where they arise: test_http_api,
test_master, test_worker_failures, test_drain.)"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from lopa.params import InvalidParameter
from lopa.scheduling.request import QueueFull, RequestAborted, SchedulerStopped
from lopa.serving.master.api.grpc_service import _abort
from lopa.serving.master.api.openai_errors import failure
from lopa.serving.master.errors import GroupUnavailable, WorkerLost
from lopa.serving.master.failures import (
    CANCELLED,
    DEADLINE,
    INTERNAL,
    INVALID,
    KINDS,
    QUEUE_FULL,
    UNAVAILABLE,
    failure_of,
)

ADDRESS = "10.1.2.3:50052"  # a worker's address: never told to a client
# (the error, its row, what the client is told, the retry-after seconds)
CASES = {
    "invalid": (InvalidParameter("max_new_tokens", "must be >= 1, got 0"), INVALID,
                "max_new_tokens: must be >= 1, got 0", None),
    "queue_full": (QueueFull("the queue is full (limits.queue_size 4)"), QUEUE_FULL,
                   "the queue is full (limits.queue_size 4)", 1),
    "group_unavailable": (GroupUnavailable("the worker group is not ready (see health)"), UNAVAILABLE,
                          "the worker group is not ready (see health)", 5),
    "draining": (GroupUnavailable("the master is shutting down", 1), UNAVAILABLE,
                 "the master is shutting down", 1),
    "stopping": (SchedulerStopped("the scheduler is stopping"), UNAVAILABLE, "the scheduler is stopping", 1),
    "worker_lost": (WorkerLost(f"worker rank 1 ({ADDRESS}) stream failed"), UNAVAILABLE,
                    "worker rank 1 was lost during this request; the master waits for the group to "
                    "re-form: retry", 5),
    "deadline": (RequestAborted("limits.request_timeout_s (2 s) passed", deadline=True), DEADLINE,
                 "limits.request_timeout_s (2 s) passed", None),
    "cancelled": (RequestAborted("the client cancelled"), CANCELLED, "the client cancelled", None),
    "internal": (RuntimeError(f"CUDA error at {ADDRESS}"), INTERNAL,
                 "internal error (see the master log)", None),
}


def test_every_kind_of_the_table_has_a_case() -> None:
    assert {kind for _, kind, _, _ in CASES.values()} == set(KINDS)
    assert len({kind.label for kind in KINDS}) == len(KINDS)  # one outcome label per kind


@pytest.mark.parametrize("case", CASES)
def test_the_http_answer_is_the_row(case: str) -> None:
    error, kind, message, retry_after = CASES[case]
    response = failure(error)
    body = json.loads(response.text)["error"]
    assert response.status == kind.http_status and body["type"] == kind.openai_type
    assert body["message"] == message and ADDRESS not in response.text
    assert body["param"] == ("max_new_tokens" if kind is INVALID else None)
    assert response.headers.get("Retry-After") == (None if retry_after is None else str(retry_after))
    assert failure_of(error).kind is kind


@pytest.fixture(scope="module")
def failing_server() -> Iterator[str]:
    """A real gRPC server whose method /failures.Test/<case> ends with that case's error."""

    def handler(case: str) -> grpc.RpcMethodHandler:
        async def fail(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            await _abort(context, CASES[case][0])
            return b""

        return grpc.unary_unary_rpc_method_handler(fail)

    handlers = grpc.method_handlers_generic_handler("failures.Test", {case: handler(case) for case in CASES})
    running: dict[str, Any] = {}
    started = threading.Event()

    async def serve() -> None:  # the server lives, and stops, on this thread's event loop
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handlers,))
        stopping = asyncio.Event()
        running.update(port=server.add_insecure_port("127.0.0.1:0"), stopping=stopping,
                       loop=asyncio.get_running_loop())
        await server.start()
        started.set()
        await stopping.wait()
        await server.stop(None)

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(10), "the test server did not start"
    yield f"127.0.0.1:{running['port']}"
    running["loop"].call_soon_threadsafe(running["stopping"].set)
    thread.join(10)
    assert not thread.is_alive(), "the test server did not stop"


@pytest.mark.parametrize("case", CASES)
def test_the_grpc_status_is_the_row(case: str, failing_server: str) -> None:
    _, kind, message, retry_after = CASES[case]
    with grpc.insecure_channel(failing_server) as channel:
        call = channel.unary_unary(f"/failures.Test/{case}")
        with pytest.raises(grpc.RpcError) as raised:
            call(b"", timeout=10)
    status = raised.value
    assert status.code() is grpc.StatusCode[kind.grpc_code]
    # gRPC names an invalid field as the GenerateRequest does (max_new_tokens is its own name)
    assert status.details() == message and ADDRESS not in status.details()
    pushback = dict(status.trailing_metadata() or ()).get("grpc-retry-pushback-ms")
    assert pushback == (None if retry_after is None else str(1000 * retry_after))
