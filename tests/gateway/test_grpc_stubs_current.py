"""The committed gRPC stubs are what `python -m ember.gateway.proto.regenerate` makes of the .proto."""

from __future__ import annotations

from pathlib import Path

from ember.gateway.proto import regenerate


def test_committed_stubs_match_the_proto(tmp_path: Path):
    regenerate.regenerate(tmp_path)
    committed = regenerate.PROTO_FILE.parent
    for name in ("inference_pb2.py", "inference_pb2.pyi", "inference_pb2_grpc.py"):
        fresh = (tmp_path / "ember" / "v1" / name).read_text()
        assert fresh == (committed / name).read_text(), f"{name} is stale: run python -m ember.gateway.proto.regenerate"
