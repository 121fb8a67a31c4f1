"""Regenerate the committed Python stubs of ember/gateway/proto/ember/v1/inference.proto:

    python -m ember.gateway.proto.regenerate            # needs grpcio-tools (a dev dependency)

protoc writes `from ember.v1 import inference_pb2`, which only works with the proto folder on sys.path;
the stubs are rewritten to a relative import so they live inside the ember package.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_FILE = PROTO_ROOT / "ember" / "v1" / "inference.proto"
GRPC_STUB = PROTO_FILE.with_name("inference_pb2_grpc.py")


def regenerate(out_dir: Path = PROTO_ROOT) -> None:
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO_FILE.relative_to(PROTO_ROOT)),
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {PROTO_FILE}")
    stub = out_dir / GRPC_STUB.relative_to(PROTO_ROOT)
    stub.write_text(stub.read_text().replace("from ember.v1 import inference_pb2", "from . import inference_pb2"))


if __name__ == "__main__":
    regenerate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT)
