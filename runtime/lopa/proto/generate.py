"""Regenerate the checked-in gRPC stubs from protos/lopa/v1 (tests check they are current).

    python -m lopa.proto.generate            # rewrite runtime/lopa/proto/*_pb2*.py

protoc names modules after the proto path (`lopa.v1`); the stubs live in `lopa.proto`,
so the one cross-module import line of each *_pb2_grpc.py is rewritten.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

PROTO_FILES = ("lopa/v1/lopa.proto", "lopa/v1/worker.proto")
HERE = Path(__file__).resolve().parent


def protos_root() -> Path:
    return HERE.parents[2] / "protos"


def generate(out_dir: Path, root: Path | None = None) -> list[Path]:
    """Compile PROTO_FILES into out_dir as lopa.proto modules; return the written files."""
    import grpc_tools
    from grpc_tools import protoc

    root = root or protos_root()
    include = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{root}", f"-I{include}", f"--python_out={tmp}", f"--grpc_python_out={tmp}"]
        if protoc.main([*args, *PROTO_FILES]) != 0:
            raise RuntimeError(f"protoc failed on {PROTO_FILES} under {root}")
        written = []
        for source in sorted((Path(tmp) / "lopa" / "v1").glob("*.py")):
            text = source.read_text().replace("from lopa.v1 import", "from lopa.proto import")
            target = out_dir / source.name
            target.write_text(text)
            written.append(target)
    return written


if __name__ == "__main__":
    for path in generate(HERE):
        print(path, file=sys.stderr)
