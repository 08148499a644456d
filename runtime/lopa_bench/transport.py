"""`lopa bench transport`: the round-trip floor of the step transport on this machine.

The serving bench's coordination time is mostly the step stream's round trip. This measures that
round trip alone, against a peer PROCESS that spins for `busy` ms per message (a CPU forward) so the
master side sits idle in between exactly as it does during a step:
  - grpc: the master's real WorkerLink (queue + gRPC stream, reply read in the calling thread) against
    a Worker.Steps server built like the worker's, with step messages of a LoPA step's size;
  - socket: the same bytes over a plain TCP loopback socket (TCP_NODELAY, length-prefixed), i.e. what
    the OS alone costs (thread and process wake-ups included).
Overhead per round = round trip - the peer's own busy time (measured by the peer, sent back).
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import struct
import time
from collections.abc import Iterator
from concurrent import futures

import grpc

from lopa.params import InvalidParameter
from lopa.proto import worker_pb2, worker_pb2_grpc
from lopa.serving.master.group.links import WorkerGroup, WorkerLink
from lopa_bench.rows import check_json, finish, show_row

TRANSPORTS = ("socket", "grpc")
WARMUP_ROUNDS = 20
_FRAME = struct.Struct("!I")
_BUSY = struct.Struct("!d")


def spin(seconds: float) -> float:
    """Busy-wait like a CPU forward (never sleeps); returns the time actually spent."""
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        pass
    return time.perf_counter() - began


def step_request(branches: int = 4, window: int = 96, masked: int = 32) -> worker_pb2.StepRequest:
    """A step message of one LoPA request's size: `branches` windows of `window` tokens."""
    request = worker_pb2.StepRequest()
    step = request.parts.add(sequence=0, start=64, n_stage=8)
    for _ in range(branches):
        masked_positions = range(window - masked, window)
        step.windows.add(tokens=range(window), block_ids=[1] * window, masked=masked_positions)
    return request


def step_reply(branches: int = 4, masked: int = 32) -> worker_pb2.StepReply:
    stats = worker_pb2.BranchStats(tokens=range(masked), probs=[0.5] * masked, confs=[-0.7] * masked)
    return worker_pb2.StepReply(parts=[worker_pb2.PartStats(branches=[stats] * branches)])


# -- peers (run in their own process) -----------------------------------------------------------------


class _BusyWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, busy_s: float) -> None:
        self.busy_s = busy_s
        self.reply = step_reply()

    def Steps(self, request_iterator: Iterator[worker_pb2.StepRequest], context: grpc.ServicerContext):
        for _ in request_iterator:
            reply = worker_pb2.StepReply()
            reply.CopyFrom(self.reply)
            reply.forward_s = spin(self.busy_s)
            yield reply


def _grpc_peer(busy_s: float, ports: multiprocessing.Queue) -> None:
    from lopa.serving.worker.service import SERVER_OPTIONS

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=SERVER_OPTIONS)
    worker_pb2_grpc.add_WorkerServicer_to_server(_BusyWorker(busy_s), server)
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def _socket_peer(busy_s: float, ports: multiprocessing.Queue) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    ports.put(listener.getsockname()[1])
    connection, _ = listener.accept()
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reply = step_reply().SerializeToString()
    while _read_frame(connection) is not None:
        busy = spin(busy_s)
        connection.sendall(_FRAME.pack(len(reply) + _BUSY.size) + _BUSY.pack(busy) + reply)


def _read_frame(connection: socket.socket) -> bytes | None:
    header = _read_exactly(connection, _FRAME.size)
    return None if header is None else _read_exactly(connection, _FRAME.unpack(header)[0])


def _read_exactly(connection: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = connection.recv(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# -- the master side ----------------------------------------------------------------------------------


def _grpc_rounds(port: int, rounds: int) -> list[float]:
    link = WorkerLink(0, f"127.0.0.1:{port}")
    link.open(WorkerGroup([link.address]))
    request, overheads = step_request(), []
    try:
        for _ in range(rounds):
            began = time.perf_counter()
            link.send(request)
            reply = link.receive(timeout=30.0)
            overheads.append(time.perf_counter() - began - reply.forward_s)
    finally:
        link.close()
    return overheads


def _socket_rounds(port: int, rounds: int) -> list[float]:
    message = step_request().SerializeToString()
    frame = _FRAME.pack(len(message)) + message
    overheads = []
    with socket.create_connection(("127.0.0.1", port), timeout=30.0) as connection:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(rounds):
            began = time.perf_counter()
            connection.sendall(frame)
            reply = _read_frame(connection)
            if reply is None:
                raise ConnectionError("the socket peer closed the connection")
            overheads.append(time.perf_counter() - began - _BUSY.unpack(reply[: _BUSY.size])[0])
    return overheads


def measure(transport: str, busy_ms: float, rounds: int) -> dict:
    """One row: the round-trip overhead (ms) of `transport` with a peer busy `busy_ms` per message."""
    context = multiprocessing.get_context("spawn")
    ports: multiprocessing.Queue = context.Queue()
    target = _grpc_peer if transport == "grpc" else _socket_peer
    peer = context.Process(target=target, args=(busy_ms / 1000, ports), daemon=True)
    peer.start()
    try:
        port = ports.get(timeout=60)
        run = _grpc_rounds if transport == "grpc" else _socket_rounds
        overheads = [1000 * s for s in run(port, WARMUP_ROUNDS + rounds)[WARMUP_ROUNDS:]]
    finally:
        peer.kill()
        peer.join()
    overheads.sort()
    return {
        "transport": transport,
        "busy_ms": busy_ms,
        "rounds": rounds,
        "median_ms": round(statistics.median(overheads), 3),
        "p90_ms": round(overheads[int(0.9 * (len(overheads) - 1))], 3),
        "mean_ms": round(statistics.fmean(overheads), 3),
    }


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser(
        "transport",
        help="round-trip floor of the step transport (gRPC stream vs a plain socket) on this machine",
        description="Ping-pong a LoPA-step-sized message with a peer process that spins BUSY ms per message; "
        "report the round trip minus the peer's busy time, for the gRPC step stream and a plain TCP socket.",
    )
    parser.add_argument("--busy-ms", default="0,10", help="peer work per message in ms, comma-separated")
    parser.add_argument("--rounds", type=int, default=300, help="measured round trips per row")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        busy = [float(b) for b in args.busy_ms.split(",") if b.strip()]
    except ValueError:
        reason = f"not a comma-separated list of numbers: {args.busy_ms!r}"
        raise InvalidParameter("busy_ms", reason) from None
    if not busy or min(busy) < 0:
        raise InvalidParameter("busy_ms", f"give one or more values >= 0, got {args.busy_ms!r}")
    if args.rounds < 1:
        raise InvalidParameter("rounds", f"must be >= 1, got {args.rounds}")
    check_json(args.json)
    rows = []
    for busy_ms in busy:
        for transport in TRANSPORTS:
            rows.append(measure(transport, busy_ms, args.rounds))
            show_row(rows[-1])
    finish(rows, args.json)
    return 0
