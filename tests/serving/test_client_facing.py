"""What clients see at the edges: the mask token refused on every prompt path, failures that name no
internal address and say when to retry, streams whose end a client can tell from a cut, and a
local `lopa serve` that listens on loopback only unless asked.

Real processes throughout: a master alone (admission needs no workers), a master and two workers
whose rank 1 is killed, a master stopped and killed under a stream, `lopa serve` itself.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from lopa.serving.client import LopaClient
from lopa.serving.launcher import LocalCluster, loopback_config
from lopa.serving.ports import free_ports
from lopa.serving.shared.config import load_config, parse_config

from .conftest import master_process, wait_for_gauges, worker_env, write_config

pytestmark = pytest.mark.slow  # one of the longest files: a parallel run starts it first

MASK = "<|mask|>"  # the tiny tokenizer's mask token, id 100
LONG = {"max_tokens": 256, "ignore_eos": True, "block_size": 4}  # a request of a few seconds


def post(port: int, path: str, body: dict[str, Any], timeout: float = 60
         ) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        reply = conn.getresponse()
        return reply.status, dict(reply.getheaders()), reply.read()
    finally:
        conn.close()


class Stream:
    """A streamed completion read in a thread: its events, and whether its body ended whole (the
    chunked body's last, empty chunk read) or was cut."""

    def __init__(self, port: int, body: dict[str, Any]) -> None:
        self.events: list[str] = []
        self.whole: bool | None = None
        self.started = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(port, body), daemon=True)
        self._thread.start()

    def _read(self, port: int, body: dict[str, Any]) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                     headers={"Content-Type": "application/json"})
        reply = conn.getresponse()
        try:
            while line := reply.readline():
                if line.startswith(b"data: "):
                    self.events.append(line[6:].strip().decode())
                    self.started.set()
            self.whole = True
        except (http.client.IncompleteRead, OSError):
            self.whole = False
        finally:
            self.started.set()
            conn.close()

    def join(self) -> Stream:
        self._thread.join(timeout=120)
        return self


# -- the mask token -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_master(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, str]]:
    """A master (no workers) of the tiny model with a chat template: (its HTTP port, its gRPC address)."""
    work = tmp_path_factory.mktemp("chat")
    model = work / "chatty"
    shutil.copytree(checkpoint, model)
    path = model / "tokenizer_config.json"
    tokenizer = json.loads(path.read_text())
    tokenizer["chat_template"] = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<bot>"
    path.write_text(json.dumps(tokenizer))
    (http,) = free_ports(1)
    config = write_config(work, model, 1, master={"http_port": http})
    with master_process(config, work / "master.log", f"http://127.0.0.1:{http}/live"):
        yield http, load_config(config).master.listen


def test_the_mask_token_is_refused_in_chat_on_both_apis(chat_master: tuple[int, str]) -> None:
    http, listen = chat_master
    for content in (f"fill {MASK} in", [{"type": "text", "text": "fill "}, {"type": "text", "text": MASK}]):
        status, _, body = post(http, "/v1/chat/completions",
                               {"model": "chatty", "messages": [{"role": "user", "content": content}]})
        error = json.loads(body)["error"]
        assert status == 400 and error["param"] == "messages", body
        assert error["message"] == "messages: contains the mask token (id 100), which only decoding may place"
    with LopaClient(listen) as client, pytest.raises(grpc.RpcError) as refused:
        client.generate(f"fill {MASK} in", chat=True, timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "chat: contains the mask token (id 100), which only decoding may place"
    # Without it the chat passes admission, and finds no worker group: 503, and when to retry.
    status, headers, body = post(http, "/v1/chat/completions",
                                 {"model": "chatty", "messages": [{"role": "user", "content": "fill in"}]})
    assert status == 503 and headers["Retry-After"] == "5", body


# -- a lost worker ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    work = tmp_path_factory.mktemp("client-facing")
    http, metrics = free_ports(2)
    raw = {"model": {"path": str(checkpoint)}, "decoding": {"block_size": 8, "max_new_tokens": 16},
           "limits": {"max_new_tokens": 256, "max_prompt_tokens": 64},
           "master": {"http_port": http, "metrics_port": metrics},
           "workers": {"join_timeout_s": 60, "step_timeout_s": 20}}
    cluster = LocalCluster(loopback_config(parse_config(raw), workers=2), work, log_dir=work)
    cluster.start(timeout=120)
    yield cluster
    cluster.stop()


def test_a_lost_worker_is_told_without_its_address_and_with_when_to_retry(cluster: LocalCluster) -> None:
    """After SIGKILL of worker 1: the requests in flight (HTTP, an HTTP stream, gRPC) and the ones
    sent while the group is down fail with bodies that name no address, 503s with Retry-After, gRPC
    with its retry pushback; the restarted group serves again."""
    port = cluster.config.master.http_port
    addresses = ["127.0.0.1", *cluster.config.workers.addresses, cluster.config.workers.rendezvous]
    body = {"model": "serving-checkpoint0", "prompt": "hello", **LONG}
    with ThreadPoolExecutor(2) as pool, LopaClient(cluster.address) as client:
        plain = pool.submit(post, port, "/v1/completions", body)
        call = client.stub.Generate.future(client.request("hello", max_new_tokens=256, ignore_eos=True,
                                                          block_size=4), timeout=120)
        stream = Stream(port, body)
        wait_for_gauges(cluster, running=3)
        cluster.workers[1].send_signal(signal.SIGKILL)
        status, headers, answer = plain.result(timeout=60)
        with pytest.raises(grpc.RpcError) as failed:
            call.result(timeout=60)
        stream.join()
    texts = [answer.decode(), failed.value.details(), *stream.events]
    assert status == 503 and headers["Retry-After"] == "5", answer
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert ("grpc-retry-pushback-ms", "5000") in failed.value.trailing_metadata()
    assert stream.whole and stream.events[-1] == "[DONE]" and "error" in json.loads(stream.events[-2])
    deadline = time.monotonic() + 30  # the group is down: new requests are refused the same way
    while (refused := post(port, "/v1/completions", body))[0] != 503 or b"not ready" not in refused[2]:
        assert time.monotonic() < deadline, refused
        time.sleep(0.2)
    assert refused[1]["Retry-After"] == "5"
    texts.append(refused[2].decode())
    print("\n".join(texts[:2] + texts[-2:]))
    assert not [t for t in texts if any(a in t for a in addresses)], texts
    cluster.restart_workers()
    assert cluster.wait_serving(120)
    assert post(port, "/v1/completions", {"model": "serving-checkpoint0", "prompt": "hi"})[0] == 200


# -- a stream the master cuts -------------------------------------------------------------------------


def test_a_stream_cut_by_the_master_ends_with_an_error_event(cluster: LocalCluster) -> None:
    """A master stopped under a stream (SIGTERM, and a second one past the drain) writes an error
    event and [DONE], and ends the body whole. A master killed outright (SIGKILL) can write nothing:
    its stream lacks both and the chunked body's last chunk, which clients report as an error (the
    OpenAI SDK raises): a client can tell a cut from an end either way."""
    assert cluster.master is not None and cluster.wait_serving(120)
    port = cluster.config.master.http_port
    body = {"model": "serving-checkpoint0", "prompt": "hello", **LONG}
    stream = Stream(port, body)
    assert stream.started.wait(60) and stream.whole is None
    cluster.master.send_signal(signal.SIGTERM)  # drains: the stream would finish...
    time.sleep(0.3)
    cluster.master.send_signal(signal.SIGTERM)  # ...but the second stops the master at once
    stream.join()
    assert cluster.master.wait(timeout=30) == 0
    error = json.loads(stream.events[-2])["error"]
    assert stream.whole and stream.events[-1] == "[DONE]", stream.events[-3:]
    assert error["type"] == "service_unavailable" and "the server is stopping" in error["message"], error

    cluster.master = cluster._spawn("master")  # a new master attaches to the same workers
    assert cluster.wait_serving(120)
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    chunks: list[Any] = []
    with pytest.raises(openai.APIError):
        for chunk in api.completions.create(model="serving-checkpoint0", prompt="hello", stream=True,
                                            max_tokens=256, extra_body={"ignore_eos": True, "block_size": 4}):
            chunks.append(chunk)
            if len(chunks) == 1:
                cluster.master.send_signal(signal.SIGKILL)
    assert chunks and all(c.choices[0].finish_reason is None for c in chunks)  # no end was seen
    cluster.master = cluster._spawn("master")  # for the module's teardown
    assert serves_again(cluster, 120)


def serves_again(cluster: LocalCluster, timeout: float) -> bool:
    """SERVING again, the workers restarted as lopa serve's launcher restarts them when one left
    the group: a master killed between sending a step to one worker and to the other leaves the
    first in a collective the second never joins, until workers.step_timeout_s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(worker.poll() is not None for worker in cluster.workers):
            cluster.restart_workers()
        if cluster.wait_serving(min(5.0, max(0.0, deadline - time.monotonic()))):
            return True
    return False


# -- lopa serve's listeners ---------------------------------------------------------------------------


def family(pid: int) -> list[int]:
    """A process and its descendants (Linux: /proc/PID/task/*/children)."""
    found, index = [pid], 0
    while index < len(found):
        for task in Path(f"/proc/{found[index]}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                found += [int(child) for child in task.read_text().split()]
        index += 1
    return found


def listeners(pid: int) -> list[str]:
    """The TCP addresses a process and its descendants listen on, as HOST:PORT (/proc/net/tcp*)."""
    inodes: set[str] = set()
    for member in family(pid):
        for fd in Path(f"/proc/{member}/fd").glob("*"):
            with contextlib.suppress(OSError):
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                address, port = fields[1].split(":")
                found.append(f"{_host(address)}:{int(port, 16)}")
    return found


def _host(hexadecimal: str) -> str:
    """/proc/net/tcp's host: 4 bytes (IPv4) or 16 (IPv6), each 32-bit word little-endian."""
    raw = b"".join(bytes.fromhex(hexadecimal[i:i + 8])[::-1] for i in range(0, len(hexadecimal), 8))
    return str(ipaddress.ip_address(raw))


@pytest.mark.parametrize("flags", [[], ["--all-interfaces"]], ids=["default", "all-interfaces"])
def test_lopa_serve_listens_on_loopback_unless_asked(checkpoint: Path, flags: list[str]) -> None:
    listen, http, metrics = free_ports(3)
    command = [sys.executable, "-m", "lopa", "serve", "--workers", "1", "--model", str(checkpoint),
               "--listen", f"127.0.0.1:{listen}", "--http-port", str(http), "--metrics-port", str(metrics),
               "--block-size", "8", "--max-new-tokens", "16", *flags]
    serve = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             env=worker_env())
    try:
        assert serve.stdout is not None
        line = serve.stdout.readline()
        assert line.startswith("lopa: serving on"), line
        found = listeners(serve.pid)
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)
    # Any address of this host: 0.0.0.0, or :: (gRPC binds 0.0.0.0 as both families' any address).
    public = sorted(int(a.rsplit(":", 1)[1]) for a in found if a.rsplit(":", 1)[0] in ("0.0.0.0", "::"))
    print(line.strip(), "listening:", sorted(found))
    if not flags:
        assert not public and len(found) >= 4, found  # the client API, HTTP, metrics, the worker
    else:  # the client ports only: the worker, its rendezvous and collective stay on loopback
        assert public == sorted((listen, http, metrics)), found
