"""The gRPC reference: services, messages and enums of protos/lopa/v1, with their comments.

protoc (grpcio-tools) compiles the files with their source info; the comments come from there, so the
page says what the .proto files say.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2

from tools.docs.markdown import cell

# FileDescriptorProto / DescriptorProto field numbers: the paths of SourceCodeInfo locations.
MESSAGE, ENUM, SERVICE, SYNTAX = 4, 5, 6, 12
FIELD, NESTED, NESTED_ENUM = 2, 3, 4
ENUM_VALUE, METHOD = 2, 2
SCALARS = {
    value: name.removeprefix("TYPE_").lower()
    for name, value in descriptor_pb2.FieldDescriptorProto.Type.items()
    if name not in ("TYPE_MESSAGE", "TYPE_ENUM", "TYPE_GROUP")
}


def compile_protos(root: Path, files: list[str]) -> descriptor_pb2.FileDescriptorSet:
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        args = ["protoc", f"-I{root}", f"-I{include}", "--include_source_info", f"--descriptor_set_out={out}"]
        if protoc.main([*args, *files]) != 0:
            raise RuntimeError(f"protoc failed on {files} under {root}")
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


class Comments:
    """A file's comments by element path (leading, else trailing), joined into one line."""

    def __init__(self, proto: descriptor_pb2.FileDescriptorProto) -> None:
        self.by_path: dict[tuple[int, ...], str] = {}
        for location in proto.source_code_info.location:
            text = location.leading_comments or location.trailing_comments
            detached = " ".join(location.leading_detached_comments)
            joined = " ".join(f"{detached} {text}".split())
            if joined:
                self.by_path[tuple(location.path)] = joined

    def __call__(self, *path: int) -> str:
        return self.by_path.get(path, "")


def render(root: Path) -> str:
    files = sorted(p.relative_to(root).as_posix() for p in root.glob("lopa/v1/*.proto"))
    lines = [
        "# gRPC API reference",
        "",
        "The services and messages of `protos/lopa/v1`: `lopa.proto` is the client API of a master; "
        "`worker.proto` is the step stream a master drives its workers with (internal to a group). "
        "Field comments are the `.proto` files' own.",
        "",
    ]
    for proto in compile_protos(root, files).file:
        if not proto.name.startswith("lopa/"):
            continue
        comments = Comments(proto)
        lines += [f"## `{proto.name}`", ""]
        intro = comments(SYNTAX)
        if intro:
            lines += [intro, ""]
        for s, service in enumerate(proto.service):
            lines += [f"### service `{proto.package}.{service.name}`", ""]
            if comments(SERVICE, s):
                lines += [comments(SERVICE, s), ""]
            lines += ["| method | request | response | meaning |", "| --- | --- | --- | --- |"]
            for m, method in enumerate(service.method):
                request = ("stream " if method.client_streaming else "") + short(method.input_type)
                response = ("stream " if method.server_streaming else "") + short(method.output_type)
                lines.append(f"| `{method.name}` | `{request}` | `{response}` | "
                             f"{cell(comments(SERVICE, s, METHOD, m))} |")
            lines.append("")
        for i, message in enumerate(proto.message_type):
            lines += render_message(message, comments, (MESSAGE, i), message.name)
        for i, enum in enumerate(proto.enum_type):
            lines += render_enum(enum, comments, (ENUM, i), enum.name)
    return "\n".join(lines)


def short(type_name: str) -> str:
    return type_name.rsplit(".", 1)[-1]


def field_type(field: descriptor_pb2.FieldDescriptorProto, maps: dict[str, str]) -> str:
    if field.type_name and short(field.type_name) in maps:
        return maps[short(field.type_name)]
    kind = short(field.type_name) if field.type_name else SCALARS[field.type]
    if field.label == field.LABEL_REPEATED:
        return f"repeated {kind}"
    return f"optional {kind}" if field.proto3_optional else kind


def render_message(message: descriptor_pb2.DescriptorProto, comments: Comments, path: tuple[int, ...],
                   name: str) -> list[str]:
    maps = {  # map<K, V> fields are nested *Entry messages: shown as the map they are
        nested.name: f"map<{field_type(nested.field[0], {})}, {field_type(nested.field[1], {})}>"
        for nested in message.nested_type if nested.options.map_entry
    }
    lines = [f"### message `{name}`", ""]
    if comments(*path):
        lines += [comments(*path), ""]
    if message.field:
        lines += ["| field | number | type | meaning |", "| --- | --- | --- | --- |"]
        for f, field in enumerate(message.field):
            lines.append(f"| `{field.name}` | {field.number} | `{field_type(field, maps)}` | "
                         f"{cell(comments(*path, FIELD, f))} |")
        lines.append("")
    for n, nested in enumerate(message.nested_type):
        if not nested.options.map_entry:
            lines += render_message(nested, comments, (*path, NESTED, n), f"{name}.{nested.name}")
    for e, enum in enumerate(message.enum_type):
        lines += render_enum(enum, comments, (*path, NESTED_ENUM, e), f"{name}.{enum.name}")
    return lines


def render_enum(enum: descriptor_pb2.EnumDescriptorProto, comments: Comments, path: tuple[int, ...],
                name: str) -> list[str]:
    lines = [f"### enum `{name}`", ""]
    if comments(*path):
        lines += [comments(*path), ""]
    lines += ["| value | number | meaning |", "| --- | --- | --- |"]
    for v, value in enumerate(enum.value):
        lines.append(f"| `{value.name}` | {value.number} | {cell(comments(*path, ENUM_VALUE, v))} |")
    return [*lines, ""]
