"""The bundled LLaDA-format model served like any checkpoint: `lopa serve --model` with 2 workers
answers its task prompts through the OpenAI HTTP API (completions and chat) and through gRPC."""

from __future__ import annotations

import json
import urllib.request

from lopa.bundled import bundled_llada_dir, tasks
from lopa.serving.client import LopaClient
from lopa.serving.ports import free_ports

from .conftest import lopa_serve


def _post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def test_the_llada_model_answers_over_http_and_grpc_with_two_workers() -> None:
    grpc_port, http_port = free_ports(2)
    address = f"127.0.0.1:{grpc_port}"
    flags = [
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
    ]
    with lopa_serve(*flags) as (serve, line):
        assert line.startswith(f"lopa: serving on {address}")
        for example in tasks.held_out(4):
            body = {"model": "lopa-bundled-llada", "prompt": example.prompt, "max_tokens": 32}
            completion = _post(http_port, "/v1/completions", body)
            text = completion["choices"][0]["text"]
            assert tasks.is_valid(example.task, example.prompt, text), (example.prompt, text)
            assert completion["lopa"]["mean_branches"] > 1  # LoPA: --branches 3
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
    assert serve.returncode == 0
