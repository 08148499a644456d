"""Hostile clients of a master's ports, for the edges tests and `lopa bench edges`.

Each runs in a process of its own (`python -m lopa_bench.attacks KIND JSON`): the measuring
process's GIL must not slow the clients, nor they the measurement. Each prints one JSON object of
what it saw.

    probe        GET (or POST) a URL every `interval` s: latencies, statuses, failures
    shapes       `copies` concurrent copies of each stalling request shape: what each got back
    slow_bodies  `count` connections each sending a request head and one body byte, reopened when
                 the server closes them: how many it evicted unanswered, how many it answered
    http2        `count` connections that open HTTP/2 and then say nothing: when the server closed each
    trickle      `count` connections sending a metrics request a byte every `every` s, reopened when
                 cut: how many were cut and how long each lasted
"""

from __future__ import annotations

import contextlib
import gzip
import http.client
import json
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

HTTP2_HELLO = (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # the client preface,
               b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # an empty SETTINGS frame
               b"\x00\x00\x00\x04\x01\x00\x00\x00\x00")  # and the acknowledgement of the server's


STOP = threading.Event()  # set by SIGTERM: a probe ends and reports what it saw


def probe(url: str, seconds: float, interval: float = 0.05, body: Any = None) -> dict[str, Any]:
    """Requests to `url` (a POST of `body` as JSON when given) until `seconds` pass or SIGTERM."""
    host, _, rest = url.removeprefix("http://").partition("/")
    name, port = host.rsplit(":", 1)
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    failures: list[str] = []
    data = json.dumps(body).encode() if body is not None else None
    end = time.monotonic() + seconds
    while time.monotonic() < end and not STOP.is_set():
        began = time.perf_counter()
        try:
            conn = http.client.HTTPConnection(name, int(port), timeout=30)
            conn.request("POST" if data else "GET", "/" + rest, body=data,
                         headers={"Content-Type": "application/json"} if data else {})
            reply = conn.getresponse()
            reply.read()
            conn.close()
            statuses[str(reply.status)] = statuses.get(str(reply.status), 0) + 1
        except OSError as error:
            failures.append(f"{type(error).__name__}: {error}")
        latencies.append(time.perf_counter() - began)
        time.sleep(interval)
    return {"latencies": latencies, "statuses": statuses, "failures": failures}


def batch_body(model: str, prompts: int) -> bytes:
    """A completions batch of one-character prompts, 4 bytes each."""
    return json.dumps({"model": model, "prompt": ["a"] * prompts}, separators=(",", ":")).encode()


def unknown_fields_message(size: int) -> bytes:
    """A GenerateRequest of `size` bytes: unknown varint fields (number 1000), then a prompt that is
    not UTF-8 (what makes the server walk the message to name the field)."""
    field = b"\xc0\x3e\x00"  # key 1000 << 3 | varint, value 0
    return field * ((size - 4) // len(field)) + b"\x0a\x02\xff\xfe"


def gzip_bomb(size: int) -> bytes:
    """`size` bytes of gzip inflating to about 1000 times as much (members of 1 MiB of zeros)."""
    member = gzip.compress(b"\0" * (1 << 20), 9)
    return member * max(1, size // len(member))


def shapes(http_port: int, grpc_address: str, model: str, copies: int, batch_prompts: int,
           grpc_bytes: list[int], gzip_bytes: int) -> dict[str, Any]:
    """Each shape's `copies` sent at once; per shape, what each copy got and the slowest answer."""
    results: dict[str, Any] = {}
    batch = batch_body(model, batch_prompts)
    bomb = gzip_bomb(gzip_bytes)
    sends: dict[str, Callable[[], str]] = {
        f"batch of {batch_prompts} prompts ({len(batch) / 1e6:.1f} MB)":
            lambda: _post(http_port, batch, {}),
        f"gzip bomb ({len(bomb) / 1e6:.1f} MB)": lambda: _post(http_port, bomb, {"Content-Encoding": "gzip"}),
    }
    for size in grpc_bytes:
        message = unknown_fields_message(size)
        sends[f"gRPC unknown fields ({size / 1e6:.1f} MB)"] = lambda m=message: _grpc_raw(grpc_address, m)
    for name, send in sends.items():
        outcomes: list[str] = []
        began = time.perf_counter()
        threads = [threading.Thread(target=_collect, args=(send, outcomes)) for _ in range(copies)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        results[name] = {"answers": sorted(outcomes), "seconds": round(time.perf_counter() - began, 3)}
    return results


def _collect(send: Callable[[], str], outcomes: list[str]) -> None:
    outcomes.append(send())


def _post(port: int, body: bytes, headers: dict[str, str]) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        headers = {"Content-Type": "application/json", **headers}
        conn.request("POST", "/v1/completions", body=body, headers=headers)
        reply = conn.getresponse()
        message = json.loads(reply.read() or b"{}").get("error", {}).get("message", "")
        return f"{reply.status} {message[:80]}"
    except OSError as error:
        return f"{type(error).__name__}"
    finally:
        conn.close()


def _grpc_raw(address: str, message: bytes) -> str:
    import grpc

    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)]) as channel:
        call = channel.unary_unary("/lopa.v1.Lopa/Generate", request_serializer=None,
                                   response_deserializer=None)
        try:
            call(message, timeout=60)
            return "OK"
        except grpc.RpcError as error:
            return f"{error.code().name} {str(error.details())[:80]}"


def slow_bodies(port: int, count: int, seconds: float, sources: list[str], reopen: bool = True,
                body_length: int = 100_000) -> dict[str, Any]:
    """`count` connections each sending a head and one body byte, reopened when closed (`reopen`)."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {body_length}\r\n\r\n{{".encode())
    opened, evicted, failed = 0, 0, 0
    answered: dict[str, int] = {}  # by status
    selector = selectors.DefaultSelector()

    def open_one() -> None:
        nonlocal opened, failed
        try:
            conn = socket.create_connection(("127.0.0.1", port), timeout=10,
                                            source_address=(sources[opened % len(sources)], 0))
            conn.sendall(head)
        except OSError:
            failed += 1
            return
        conn.setblocking(False)
        selector.register(conn, selectors.EVENT_READ)
        opened += 1

    for _ in range(count):
        open_one()
    end = time.monotonic() + seconds
    while time.monotonic() < end + 1.0:  # the last second: no reopening, the last closes counted
        for key, _ in selector.select(timeout=0.1):
            conn = key.fileobj
            try:
                data = conn.recv(4096)  # type: ignore[union-attr]
            except OSError:
                data = b""
            if data:
                status = data.split(b" ", 2)[1].decode(errors="replace") if data.count(b" ") >= 2 else "?"
                answered[status] = answered.get(status, 0) + 1
            else:
                evicted += 1
            selector.unregister(conn)
            conn.close()  # type: ignore[union-attr]
            if reopen and time.monotonic() < end:
                open_one()
    for key in list(selector.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    return {"opened": opened, "evicted": evicted, "answered": answered, "connect_failures": failed}


def http2(port: int, count: int, seconds: float) -> dict[str, Any]:
    """`count` HTTP/2 connections that say nothing after the preface; when the server closed each."""
    selector = selectors.DefaultSelector()
    opened_at: dict[socket.socket, float] = {}
    refused = 0
    for _ in range(count):
        try:
            conn = socket.create_connection(("127.0.0.1", port), timeout=10)
            conn.sendall(HTTP2_HELLO)
        except OSError:
            refused += 1
            continue
        conn.setblocking(False)
        selector.register(conn, selectors.EVENT_READ)
        opened_at[conn] = time.monotonic()
    lifetimes: list[float] = []
    end = time.monotonic() + seconds
    while opened_at and time.monotonic() < end:
        for key, _ in selector.select(timeout=0.1):
            conn = key.fileobj  # type: ignore[assignment]
            with contextlib.suppress(BlockingIOError):
                try:
                    if conn.recv(65536):
                        continue  # the server's SETTINGS, a GOAWAY: not yet closed
                except OSError:
                    pass
                lifetimes.append(time.monotonic() - opened_at.pop(conn))
                selector.unregister(conn)
                conn.close()
    for conn in opened_at:
        conn.close()
    at_accept = sum(1 for t in lifetimes if t < 0.5)
    later = [t for t in lifetimes if t >= 0.5]
    return {"connected": count - refused, "connect_failures": refused, "closed_at_accept": at_accept,
            "closed_later": len(later), "longest_s": round(max(later, default=0.0), 2),
            "still_open": len(opened_at)}


def trickle(port: int, count: int, seconds: float, every: float) -> dict[str, Any]:
    """`count` connections sending a metrics request a byte every `every` s (the head never ends),
    reopened when cut; each checked for its cut every 0.1 s."""
    head = b"GET /metrics HTTP/1.1\r\nHost: scraper.example\r\nX-Trickle: "  # then "a" for ever
    live: dict[socket.socket, list[float]] = {}  # -> [opened at, last byte at, bytes sent]
    lifetimes: list[float] = []

    def open_one() -> None:
        with contextlib.suppress(OSError):
            conn = socket.create_connection(("127.0.0.1", port), timeout=10)
            conn.setblocking(False)
            live[conn] = [time.monotonic(), 0.0, 0]

    def cut(conn: socket.socket, state: list[float]) -> bool:
        try:
            if time.monotonic() - state[1] >= every:
                sent = int(state[2])
                conn.send(head[sent:sent + 1] if sent < len(head) else b"a")
                state[1], state[2] = time.monotonic(), sent + 1
            return conn.recv(1) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    for _ in range(count):
        open_one()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for conn, state in list(live.items()):
            if cut(conn, state):
                lifetimes.append(time.monotonic() - state[0])
                del live[conn]
                conn.close()
                open_one()
        time.sleep(0.1)
    for conn in live:
        conn.close()
    return {"cut": len(lifetimes), "longest_s": round(max(lifetimes, default=0.0), 2)}


def spawn(kind: str, env: dict[str, str] | None = None, **arguments: Any) -> subprocess.Popen:
    """Run one of KINDS in a process of its own; `collect` its report."""
    return subprocess.Popen([sys.executable, "-m", "lopa_bench.attacks", kind, json.dumps(arguments)],
                            stdout=subprocess.PIPE, text=True, env=env)


def collect(process: subprocess.Popen, timeout: float = 600) -> dict[str, Any]:
    out, _ = process.communicate(timeout=timeout)
    if process.returncode != 0:
        raise RuntimeError(f"attack exited with code {process.returncode}: {out[-500:]}")
    return json.loads(out)


def stop_probe(process: subprocess.Popen) -> dict[str, Any]:
    """A probe ends (SIGTERM) and reports."""
    process.send_signal(signal.SIGTERM)
    return collect(process)


KINDS: dict[str, Callable[..., dict[str, Any]]] = {
    "probe": probe, "shapes": shapes, "slow_bodies": slow_bodies, "http2": http2, "trickle": trickle,
}


def main(argv: list[str]) -> int:
    import resource

    signal.signal(signal.SIGTERM, lambda *_: STOP.set())
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # thousands of connections
    kind, arguments = argv[0], json.loads(argv[1])
    print(json.dumps(KINDS[kind](**arguments)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
