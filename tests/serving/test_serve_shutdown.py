"""`lopa serve` stopped with more work queued than its drain bound (limits.request_timeout_s): the
first SIGINT or SIGTERM drains as a pod does, and every stream ends with [DONE], after its whole
answer or after an error event, never with a bare end of file; the process exits within the bound
plus the stated margin."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from lopa.bundled import tasks
from lopa.cli.serve import DRAIN_MARGIN_S
from lopa.serving.ports import free_ports

from .conftest import lopa_serve

BOUND_S = 2.0  # limits.request_timeout_s: the drain bound
STREAMS = 12  # one at a time (max_batch 1), each a few hundred ms: several times the bound


def _stream(port: int, prompt: str, lines: list[str], started: threading.Event) -> None:
    body = {"model": "lopa-bundled", "prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            for raw in response:
                line = raw.decode().strip()
                if line:
                    lines.append(line)
                    started.set()
    except Exception as error:  # the request itself refused (503 while draining) is an outcome too
        lines.append(f"http-error {error}")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_every_stream_ends_with_done_and_the_process_within_the_bound(tmp_path: Path, signum: int) -> None:
    grpc_port, http_port = free_ports(2)
    config = tmp_path / "lopa.yaml"
    config.write_text(
        yaml.safe_dump({"limits": {"max_batch": 1, "queue_size": 32, "request_timeout_s": BOUND_S}})
    )
    flags = ["--config", str(config), "--workers", "2", "--listen", f"127.0.0.1:{grpc_port}",
             "--http-port", str(http_port)]
    with lopa_serve(*flags) as (serve, _):
        outputs: list[list[str]] = [[] for _ in range(STREAMS)]
        started = threading.Event()
        prompts = [e.prompt for e in tasks.held_out(STREAMS)]
        threads = [
            threading.Thread(target=_stream, args=(http_port, p, out, started))
            for p, out in zip(prompts, outputs, strict=True)
        ]
        for thread in threads:
            thread.start()
        assert started.wait(60)
        signalled = time.monotonic()
        serve.send_signal(signum)
        serve.communicate(timeout=BOUND_S + DRAIN_MARGIN_S + 30)
        exited = time.monotonic() - signalled
        for thread in threads:
            thread.join(timeout=30)
    assert serve.returncode == 0
    assert exited < BOUND_S + DRAIN_MARGIN_S
    finished = errored = refused = 0
    for lines in outputs:
        if lines and lines[0].startswith("http-error"):
            refused += 1  # not admitted: an HTTP error status, not a cut stream
            continue
        assert lines and lines[-1] == "data: [DONE]", lines[-3:]  # never a bare end of file
        last = json.loads(lines[-2].removeprefix("data: "))
        if "error" in last:
            errored += 1
        else:
            assert last["choices"][0]["finish_reason"] == "length", last
            finished += 1
    assert finished >= 1 and errored + refused >= 1, (finished, errored, refused)
