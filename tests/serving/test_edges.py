"""The master's edges under abuse: huge inputs refused before any work, connections bounded, quiet logs.

A real `lopa master` process (no workers: its health is NOT_SERVING, yet it answers) with its HTTP
API on a short header timeout and a connection limit. /health is polled from a thread throughout
and must answer within 100 ms.
"""

from __future__ import annotations

import contextlib
import json
import resource
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from lopa.serving.client import LopaClient
from lopa.serving.ports import free_ports
from lopa.serving.shared.config import load_config

from .conftest import worker_env, write_config

MAX_CONNECTIONS = 1100
HEADER_TIMEOUT_S = 3.0  # long enough for 2,200 connections on a loaded 2-core machine


class Master:
    def __init__(self, process: subprocess.Popen, http: int, listen: str, log: Path) -> None:
        self.process, self.http, self.listen, self.log = process, http, listen, log

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http}{path}"

    def log_lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines()


@pytest.fixture(scope="module")
def master(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Master]:
    work = tmp_path_factory.mktemp("edges")
    (http,) = free_ports(1)
    config = write_config(work, checkpoint, 1, master={
        "http_port": http, "http_max_connections": MAX_CONNECTIONS, "http_header_timeout_s": HEADER_TIMEOUT_S,
        "http_keepalive_timeout_s": 2, "http_body_timeout_s": 2,
        "http_max_connections_per_client": 0})  # one client address floods here: the port's own limit
    log = work / "master.log"
    with log.open("wb") as sink:
        process = subprocess.Popen([sys.executable, "-m", "lopa", "master", "--config", str(config)],
                                   stdout=sink, stderr=subprocess.STDOUT, env=worker_env())
    started = Master(process, http, load_config(config).master.listen, log)
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(started.url("/live"), timeout=2)
            break
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
    yield started
    process.terminate()
    process.wait(timeout=30)


class HealthWatch:
    """Polls /health from a thread; the slowest answer is what a kubelet or a gateway would see."""

    def __init__(self, master: Master) -> None:
        self.master, self.slowest, self.failures = master, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.perf_counter()
            try:
                urllib.request.urlopen(self.master.url("/health"), timeout=5)
            except urllib.error.HTTPError as error:  # 503 without workers: still an answer
                assert error.code == 503
            except OSError:
                self.failures += 1
            self.slowest = max(self.slowest, time.perf_counter() - began)
            time.sleep(0.02)

    def __enter__(self) -> HealthWatch:
        with contextlib.suppress(urllib.error.HTTPError):  # warm: the first answer loads code
            urllib.request.urlopen(self.master.url("/health"), timeout=10)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def answer_to_head(port: int, head: bytes) -> bytes:
    """The first line of the answer to a request's head alone, its body never sent: a server that
    answers has refused the body from its declared length, before reading any of it."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(head)
        return conn.recv(4096).split(b"\r\n", 1)[0]


def test_a_huge_prompt_is_refused_at_once_while_health_answers(master: Master) -> None:
    prompt = "a" * 8_000_000
    body = json.dumps({"model": "serving-checkpoint0", "prompt": prompt}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode())
    with HealthWatch(master) as health:
        # (the time this takes on an idle machine is in BENCHMARKS, "The master's edges")
        status = answer_to_head(master.http, head)
        assert status.startswith(b"HTTP/1.1 413"), status
        # Below the body limit but longer than any prompt can be: refused before tokenizing.
        within = json.dumps({"model": "serving-checkpoint0", "prompt": "a" * 100_000}).encode()
        request = urllib.request.Request(master.url("/v1/completions"), data=within,
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 400
        with LopaClient(master.listen) as client:
            # Over the message limit derived from the limits (as the HTTP body's): gRPC refuses it
            # itself, off the event loop.
            with pytest.raises(grpc.RpcError) as error:
                client.generate(prompt, timeout=30)
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "larger than max" in str(error.value.details())
            # Under it but longer than any prompt can be: refused before tokenizing.
            request = client.request("a" * 100_000)
            began = time.perf_counter()
            request.SerializeToString()  # what this side spends before the server sees a byte
            own = time.perf_counter() - began
            began = time.perf_counter()
            with pytest.raises(grpc.RpcError) as error:
                client.stub.Generate(request, timeout=30)
            assert time.perf_counter() - began - own < 0.5  # no tokenizing: a loaded machine's bound
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            message = "prompt: 100000 characters cannot fit the server limit of 64 tokens"
            assert str(error.value.details()).startswith(message)
            with pytest.raises(grpc.RpcError) as error:
                client.generate("ab", timeout=30, stop=["x"] * 65)
            assert "stop: at most 64 stop sequences, got 65" in str(error.value.details())
    assert health.failures == 0 and health.slowest < 0.5, health.slowest


def hold(port: int, count: int) -> list[socket.socket]:
    held = []
    for _ in range(count):
        conn = socket.create_connection(("127.0.0.1", port), timeout=10)
        conn.setblocking(False)
        held.append(conn)
    return held


def closed_by_server(conn: socket.socket) -> bool:
    try:
        return conn.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


@pytest.fixture
def descriptors() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard < 4000:
        pytest.skip(f"needs 4000 open descriptors, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def test_idle_connections_are_closed_by_the_timeouts(master: Master, descriptors: None) -> None:
    held = hold(master.http, 1000)
    try:
        time.sleep(HEADER_TIMEOUT_S + 1.5)
        assert sum(closed_by_server(c) for c in held) == 1000
    finally:
        for conn in held:
            conn.close()


# A flood of connections from another process (this one's GIL would slow the health watch too):
# it prints how many the server closed before the header timeout could close any.
FLOOD = """
import resource, socket, sys, time
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
port, count, window = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
began, held = time.monotonic(), []
for _ in range(count):
    conn = socket.create_connection(("127.0.0.1", port), timeout=10)
    conn.setblocking(False)
    held.append(conn)
def closed(conn):
    try:
        return conn.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
evicted = 0
while time.monotonic() - began < window:
    time.sleep(0.05)
    evicted = sum(closed(c) for c in held)
print(evicted)
"""


def test_a_burst_at_the_connection_limit_leaves_health_and_the_log(master: Master, descriptors: None) -> None:
    before = len(master.log_lines())
    with HealthWatch(master) as health:
        flood = subprocess.run([sys.executable, "-c", FLOOD, str(master.http), str(2 * MAX_CONNECTIONS),
                                str(0.9 * HEADER_TIMEOUT_S)], capture_output=True, text=True, timeout=60)
    assert flood.returncode == 0, flood.stderr
    assert int(flood.stdout) >= MAX_CONNECTIONS  # the oldest idle ones gave way at the limit
    # Every probe answered, none waited for a timeout (setting up 2,200 connections in 0.2 s keeps
    # the master's loop busy for about as long, so one probe may wait that long).
    assert health.failures == 0 and health.slowest < HEADER_TIMEOUT_S / 2, health.slowest
    added = master.log_lines()[before:]
    assert len(added) < 100, added[:20]


def test_ordinary_client_events_log_one_line_and_errors_have_openai_shape(master: Master) -> None:
    before = len(master.log_lines())
    with socket.create_connection(("127.0.0.1", master.http), timeout=10) as conn:  # gone mid-request
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
    with socket.create_connection(("127.0.0.1", master.http), timeout=10) as conn:
        conn.sendall(b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = conn.recv(65536)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"400" and b"Server: lopa\r\n" in head
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    for path, method, status in (("/v1/nothing", "GET", 404), ("/v1/models", "POST", 405)):
        data = b"" if method == "POST" else None
        request = urllib.request.Request(master.url(path), method=method, data=data)
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(request, timeout=10)
        assert error.value.code == status and set(json.load(error.value)["error"]) >= {"message", "type"}
        assert error.value.headers["Server"] == "lopa"
    with urllib.request.urlopen(master.url("/live"), timeout=10) as reply:
        assert reply.headers["Server"] == "lopa"
    with LopaClient(master.listen) as client:
        assert client.model_info().model == "serving-checkpoint0"  # the model's name, not a path
    time.sleep(0.5)
    added = master.log_lines()[before:]
    events = [line for line in added if "lopa.access" not in line]  # the access log: a line per answer
    assert not any("Traceback" in line for line in added) and len(events) <= 4, events
    assert any('"GET /v1/nothing HTTP/1.1" 404' in line for line in added), added


def test_chat_on_a_model_without_a_template_is_a_clear_400(master: Master) -> None:
    """The tiny checkpoint has no chat template: chat is refused before any work, naming messages."""
    api = openai.OpenAI(base_url=master.url("/v1"), api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model="serving-checkpoint0", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["param"] == "messages"
    assert "no chat template; send a plain prompt to /v1/completions" in caught.value.body["message"]
