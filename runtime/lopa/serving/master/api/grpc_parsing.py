"""Requests whose bytes do not parse get INVALID_ARGUMENT naming the field, not UNKNOWN.

gRPC parses a request before the servicer sees it; a string field that is not valid UTF-8 then
fails inside gRPC, which answers UNKNOWN and logs a traceback per request (a cheap way to flood
the logs). The servicer is registered here with parsers that hand such a request to it as an
`Undecodable`, which names the field (found by walking the wire format against the message's
descriptor), so the servicer refuses it like any other bad input.

The parser runs on the event loop, so its cost is bounded: the message's size by the server's
grpc.max_receive_message_length (derived from the limits), protobuf's own parse by that size, and
the walk, in Python, by WALK_FIELDS fields (a message of many small unknown fields is refused
unnamed past it).
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from lopa.proto import lopa_pb2, lopa_pb2_grpc

SERVICE = "lopa.v1.Lopa"
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
WALK_FIELDS = 4096  # fields read looking for the bad string: about a millisecond


class Undecodable:
    """What a request that does not parse becomes: the reason, naming the field when it can."""

    def __init__(self, message: str) -> None:
        self.message = message


def parser(message_type: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    def parse(data: bytes) -> Message | Undecodable:
        try:
            return message_type.FromString(data)
        except DecodeError:
            descriptor = message_type.DESCRIPTOR
            field = bad_string_field(descriptor, data, budget=[WALK_FIELDS])
            if field is not None:
                return Undecodable(f"{field}: is not valid UTF-8")
            return Undecodable(f"request: cannot be parsed as {descriptor.full_name}")

    return parse


def bad_string_field(descriptor: Descriptor, data: bytes, prefix: str = "",
                     budget: list[int] | None = None) -> str | None:
    """The name (`prompt`, `stop[1]`, `decoding.conf`) of the first string field whose bytes are not
    UTF-8, or None (also for bytes that are not a message at all, and once `budget[0]` fields, shared
    with the nested messages' walks, are read)."""
    budget = [WALK_FIELDS] if budget is None else budget
    seen: dict[int, int] = {}
    position = 0
    try:
        while position < len(data):
            budget[0] -= 1
            if budget[0] < 0:
                return None
            key, position = _varint(data, position)
            number, wire_type = key >> 3, key & 7
            if wire_type == _VARINT:
                _, position = _varint(data, position)
            elif wire_type in (_I64, _I32):
                position += 8 if wire_type == _I64 else 4
            elif wire_type == _LEN:
                size, position = _varint(data, position)
                chunk, position = data[position : position + size], position + size
                field = descriptor.fields_by_number.get(number)
                name = _name(field, prefix, seen) if field is not None else None
                if field is None or name is None:
                    continue
                if field.type == FieldDescriptor.TYPE_STRING:
                    chunk.decode("utf-8")
                elif field.type == FieldDescriptor.TYPE_MESSAGE:
                    inner = bad_string_field(field.message_type, chunk, name + ".", budget)
                    if inner is not None:
                        return inner
            else:
                return None  # groups or garbage: no field to name
    except UnicodeDecodeError:
        return name
    except IndexError:
        return None
    return None


def _name(field: FieldDescriptor, prefix: str, seen: dict[int, int]) -> str:
    if not field.is_repeated:
        return prefix + field.name
    index = seen.get(field.number, 0)
    seen[field.number] = index + 1
    return f"{prefix}{field.name}[{index}]"


def _varint(data: bytes, position: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, position
        shift += 7


def add_lopa_servicer(servicer: lopa_pb2_grpc.LopaServicer, server: grpc.aio.Server) -> None:
    """lopa_pb2_grpc.add_LopaServicer_to_server, with parsers that never raise."""
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.Generate,
            request_deserializer=parser(lopa_pb2.GenerateRequest),
            response_serializer=lopa_pb2.GenerateResponse.SerializeToString,
        ),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream,
            request_deserializer=parser(lopa_pb2.GenerateRequest),
            response_serializer=lopa_pb2.GenerateChunk.SerializeToString,
        ),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo,
            request_deserializer=parser(lopa_pb2.ModelInfoRequest),
            response_serializer=lopa_pb2.ModelInfo.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
