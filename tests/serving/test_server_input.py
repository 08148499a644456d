"""What a master (in-process, no workers) answers to bad input and to a busy port.

Requests are validated before the worker group is needed, so these run without worker processes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

import lopa
from lopa.proto import lopa_pb2
from lopa.serving.client import LopaClient
from lopa.serving.master.server import serve_master
from lopa.serving.ports import free_ports
from lopa.serving.shared.config import ServingConfig, parse_config
from lopa.serving.worker.service import WorkerService, listen_address, listen_key, start_server

MAX_LENGTH = 512  # the tiny checkpoint's max_position_embeddings, below the default limits


def master_config(checkpoint: Path) -> ServingConfig:
    master, rendezvous, worker = free_ports(3)
    return parse_config({
        "model": {"path": str(checkpoint)},
        "decoding": {"block_size": 8, "max_new_tokens": 56},
        "master": {"listen": f"127.0.0.1:{master}", "metrics_port": 0},
        "workers": {"addresses": [f"127.0.0.1:{worker}"], "listen_port": 0,
                    "rendezvous": f"127.0.0.1:{rendezvous}"},
    })


class Loop:
    """An event loop in a thread, to run serve_master beside sync test code."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def submit(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


async def _started(config: ServingConfig) -> asyncio.Task:
    started = asyncio.Event()
    task = asyncio.ensure_future(serve_master(config, started))
    waiting = asyncio.ensure_future(started.wait())
    await asyncio.wait([task, waiting], return_when=asyncio.FIRST_COMPLETED)
    waiting.cancel()
    if task.done():
        task.result()  # raise the start-up error
    return task


async def _stopped(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.fixture(scope="module")
def master(checkpoint: Path) -> Iterator[tuple[Loop, ServingConfig]]:
    loop, config = Loop(), master_config(checkpoint)
    task = loop.submit(_started(config)).result(timeout=60)
    yield loop, config
    loop.submit(_stopped(task)).result(timeout=30)
    loop.close()


@pytest.fixture(scope="module")
def client(master: tuple[Loop, ServingConfig]) -> Iterator[LopaClient]:
    with LopaClient(master[1].master.listen) as c:
        yield c


def refused(client: LopaClient, prompt: Any, **kwargs: Any) -> str:
    with pytest.raises(grpc.RpcError) as error:
        client.generate(prompt, timeout=30, **kwargs)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    return str(error.value.details())


# -- a busy port ------------------------------------------------------------------------------------


def test_a_second_master_on_the_same_port_is_refused(master: tuple[Loop, ServingConfig]) -> None:
    loop, config = master
    listen = config.master.listen
    with pytest.raises(OSError, match=f"master.listen: cannot listen on {listen}: already in use"):
        loop.submit(_started(config)).result(timeout=60)


def test_a_master_on_a_port_held_by_another_socket_is_refused(checkpoint: Path) -> None:
    config = master_config(checkpoint)
    host, _, port = config.master.listen.rpartition(":")
    loop = Loop()
    with socket.socket() as held:
        held.bind((host, int(port)))
        held.listen()
        try:
            with pytest.raises(OSError, match=r"master\.listen: .* already in use or not an address"):
                loop.submit(_started(config)).result(timeout=60)
        finally:
            loop.close()


def test_a_second_worker_server_on_the_same_port_is_refused() -> None:
    service = WorkerService(0, 1, 128, 64, on_fatal=lambda code: None)
    address = f"127.0.0.1:{free_ports(1)[0]}"
    first = start_server(service, address)
    try:
        with pytest.raises(OSError, match=f"workers.listen_port: cannot listen on {address}: already in use"):
            start_server(service, address).stop(None)
    finally:
        first.stop(None)


# -- chat without a template ------------------------------------------------------------------------


def test_chat_on_a_model_without_a_template_is_invalid_argument(client: LopaClient) -> None:
    details = refused(client, "hi", chat=True)
    assert details == (
        "chat: the model has no chat template (tokenizer_config.json has no chat_template); "
        "send a plain prompt"
    )


# -- limits and lengths -----------------------------------------------------------------------------


def test_model_info_reports_usable_limits_and_the_default_length(client: LopaClient) -> None:
    info = client.model_info()
    assert info.max_length == MAX_LENGTH
    assert (info.max_new_tokens, info.max_prompt_tokens) == (MAX_LENGTH, MAX_LENGTH)  # limits 1024, 2048
    assert info.default_max_new_tokens == 56 and info.defaults.block_size == 8
    assert info.server_version == lopa.__version__


def test_length_errors_name_the_field_at_fault_with_numbers(client: LopaClient) -> None:
    prompt = "prompt: 508 tokens leave no room for one block of 8 in max_length 512"
    assert refused(client, [5] * 508) == prompt
    budget = ("max_new_tokens: prompt 300 + max_new_tokens 256 exceed max_length 512 in whole blocks of 8; "
              "at most 208")
    assert refused(client, [5] * 300, max_new_tokens=256) == budget
    assert refused(client, [5] * 4, max_new_tokens=600) == "max_new_tokens: 600 exceeds the server limit 512"
    # A block wider than the answer is no error (the answer is the block's first tokens): these pass
    # admission and only then find no worker group.
    for kwargs in ({"block_size": 300}, {"block_size": 300, "max_new_tokens": 40}):
        with pytest.raises(grpc.RpcError) as error:
            client.generate([5] * 4, timeout=30, **kwargs)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE, error.value.details()


def test_a_worker_bind_error_names_the_key_the_port_came_from(checkpoint: Path) -> None:
    config = master_config(checkpoint)
    assert listen_key(config, 0) == "workers.addresses[0]"  # listen_port 0: each rank's own address
    fixed = dataclasses.replace(config, workers=dataclasses.replace(config.workers, listen_port=50052))
    assert listen_key(fixed, 0) == "workers.listen_port"
    # and where it binds: a local group only on its loopback addresses, a pod on every interface
    assert listen_address(config, 0) == config.workers.addresses[0]
    assert listen_address(fixed, 0) == "0.0.0.0:50052"


# -- bytes that do not parse ------------------------------------------------------------------------


def _raw_call(client: LopaClient, method: str, data: bytes) -> grpc.RpcError:
    call = client.channel.unary_unary(f"/lopa.v1.Lopa/{method}")  # bytes in, bytes out
    with pytest.raises(grpc.RpcError) as error:
        call(data, timeout=30)
    return error.value


def _with_bad_utf8(request: lopa_pb2.GenerateRequest, text: str) -> bytes:
    return request.SerializeToString().replace(text.encode(), b"\xff\xfe" + text.encode()[2:])


@pytest.mark.parametrize(
    ("request_", "text", "field"),
    [
        (lopa_pb2.GenerateRequest(prompt="hello"), "hello", "prompt"),
        (lopa_pb2.GenerateRequest(prompt="hi", stop=["ab", "zzzz"]), "zzzz", "stop[1]"),
        (lopa_pb2.GenerateRequest(prompt="hi", decoding=lopa_pb2.DecodingOverrides(conf="margin")), "margin",
         "decoding.conf"),
    ],
)
def test_invalid_utf8_is_invalid_argument_naming_the_field(
    client: LopaClient, caplog: pytest.LogCaptureFixture, request_: lopa_pb2.GenerateRequest, text: str,
    field: str,
) -> None:
    """INVALID_ARGUMENT naming the field, not UNKNOWN with a traceback logged at ERROR per request."""
    for method in ("Generate", "GenerateStream"):
        with caplog.at_level("ERROR"):
            error = _raw_call(client, method, _with_bad_utf8(request_, text))
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert error.details() == f"{field}: is not valid UTF-8"
        assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_bytes_that_are_no_request_at_all_are_invalid_argument(client: LopaClient) -> None:
    error = _raw_call(client, "Generate", b"\x0a\xff\xff\xff\xff\xff")  # a length past the end
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "request: cannot be parsed as lopa.v1.GenerateRequest"


def test_a_text_prompt_holding_the_mask_token_names_the_prompt(client: LopaClient) -> None:
    """The error names prompt, the field sent, not prompt_token_ids, which the client never sent."""
    details = refused(client, "ab<|mask|>cd")
    assert details.startswith("prompt: contains the mask token (id "), details
    assert refused(client, [5, 1000]).startswith("prompt_token_ids: ids [1000] are outside the vocabulary")
