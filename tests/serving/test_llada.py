"""The bundled LLaDA-format model served like any checkpoint: `lopa serve --model` with 2 workers
answers its task prompts through the OpenAI HTTP API (completions and chat) and through gRPC."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request

from lopa.bundled import bundled_llada_dir, tasks
from lopa.serving.client import LopaClient
from lopa.serving.launcher import free_ports

from .conftest import worker_env


def _post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def test_the_llada_model_answers_over_http_and_grpc_with_two_workers() -> None:
    grpc_port, http_port = free_ports(2)
    address = f"127.0.0.1:{grpc_port}"
    command = [
        sys.executable,
        "-m",
        "lopa",
        "serve",
        "--model",
        str(bundled_llada_dir()),
        "--workers",
        "2",
        "--branches",
        "3",
        "--listen",
        address,
        "--http-port",
        str(http_port),
        "--start-timeout",
        "120",
    ]
    serve = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=worker_env()
    )
    try:
        line = serve.stdout.readline()
        assert line.startswith(f"lopa: serving on {address}"), serve.communicate(timeout=30)[1][-3000:]
        examples = tasks.held_out(4)
        for example in examples:
            body = {"model": "lopa-bundled-llada", "prompt": example.prompt, "max_tokens": 32}
            completion = _post(http_port, "/v1/completions", body)
            text = completion["choices"][0]["text"]
            assert tasks.is_valid(example.task, example.prompt, text), (example.prompt, text)
            assert completion["lopa"]["mean_branches"] > 1  # LoPA: --branches 3, granted in full
            chat = _post(
                http_port,
                "/v1/chat/completions",
                {
                    "model": "lopa-bundled-llada",
                    "max_tokens": 32,
                    "messages": [{"role": "user", "content": example.prompt}],
                },
            )
            assert chat["choices"][0]["message"]["content"] == text  # the bundled template: the bare prompt
            with LopaClient(address) as client:
                assert client.generate(example.prompt, timeout=60).text == text
        serve.send_signal(signal.SIGINT)
        serve.communicate(timeout=60)
    finally:
        serve.kill()
    assert serve.returncode == 0
