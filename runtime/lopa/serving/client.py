"""A small Python client of the LoPA master (sync; TLS optional)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lopa.params import InvalidParameter
from lopa.proto import lopa_pb2, lopa_pb2_grpc
from lopa.serving.shared.tls import channel_credentials


class LopaClient:
    def __init__(
        self,
        address: str,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        tls: bool = False,
        api_key: str | None = None,
    ) -> None:
        """ca, cert, key: TLS (the CA bundle, a client certificate and its key); api_key: sent with
        every call of the API (a master started with LOPA_API_KEY refuses calls without one)."""
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        if tls or ca or cert:
            self.channel = grpc.secure_channel(address, channel_credentials(ca, cert, key))
        else:
            self.channel = grpc.insecure_channel(address)
        self.stub = lopa_pb2_grpc.LopaStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> LopaClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @staticmethod
    def request(
        prompt: str | Sequence[int],
        max_new_tokens: int | None = None,
        stop: Sequence[str] = (),
        chat: bool = False,
        pin_branches: bool = False,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = (),
        include_stop_str_in_output: bool = False,
        top_logprobs: int = 0,
        n: int = 1,
        **decoding: Any,
    ) -> lopa_pb2.GenerateRequest:
        """pin_branches: under load, wait for room for every branch asked instead of getting fewer;
        ignore_eos: never fill an end token (the answer is exactly max_new_tokens long);
        stop_token_ids, include_stop_str_in_output: vLLM's; top_logprobs: each answer token's
        most probable alternatives returned with it; n: samples of the prompt (seeds seed + j; the
        answer's `samples`, or the stream's chunks by `index`)."""
        request = lopa_pb2.GenerateRequest(
            stop=list(stop), chat=chat, pin_branches=pin_branches, ignore_eos=ignore_eos,
            stop_token_ids=list(stop_token_ids), include_stop_str_in_output=include_stop_str_in_output,
            top_logprobs=top_logprobs,
        )
        if isinstance(prompt, str):
            request.prompt = prompt
        else:
            request.prompt_token_ids.extend(int(t) for t in prompt)
        if max_new_tokens is not None:
            _set(request, "max_new_tokens", max_new_tokens)
        if n != 1:
            _set(request, "n", n)
        for name, value in decoding.items():
            if value is not None:
                _set(request.decoding, name, value)
        return request

    def generate(self, prompt: str | Sequence[int], timeout: float | None = None, **kw: Any) -> Any:
        return self.stub.Generate(self.request(prompt, **kw), timeout=timeout, metadata=self.metadata)

    def stream(
        self, prompt: str | Sequence[int], timeout: float | None = None, **kw: Any
    ) -> Iterator[lopa_pb2.GenerateChunk]:
        return self.stub.GenerateStream(self.request(prompt, **kw), timeout=timeout, metadata=self.metadata)

    def model_info(self, timeout: float | None = 10.0) -> lopa_pb2.ModelInfo:
        return self.stub.GetModelInfo(lopa_pb2.ModelInfoRequest(), timeout=timeout, metadata=self.metadata)

    def health(self, service: str = "", timeout: float = 5.0) -> str:
        """SERVING, NOT_SERVING, ... or UNREACHABLE."""
        try:
            reply = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def wait_serving(self, timeout: float) -> bool:
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.health(timeout=2.0) == "SERVING":
                return True
            time.sleep(0.2)
        return False


_UNSIGNED_MAX = {FieldDescriptor.TYPE_UINT32: 2**32 - 1, FieldDescriptor.TYPE_UINT64: 2**64 - 1}
_AT_LEAST_ONE = {"max_new_tokens": 1, "block_size": 1}  # the server refuses 0 for these


def _set(message: Message, name: str, value: Any) -> None:
    """message.name = value; InvalidParameter naming the field when an unsigned field cannot hold it
    (protobuf would raise a bare 'Value out of range')."""
    highest = _UNSIGNED_MAX.get(message.DESCRIPTOR.fields_by_name[name].type)
    lowest = _AT_LEAST_ONE.get(name, 0)
    if highest is not None and isinstance(value, int) and not lowest <= value <= highest:
        bound = f"must be >= {lowest}" if value < lowest else f"must be <= {highest}"
        raise InvalidParameter(name, f"{bound}, got {value}")
    setattr(message, name, value)
