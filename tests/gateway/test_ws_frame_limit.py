"""WebSocket request frames are held to the gateway's `limits.max_body_bytes`, like HTTP bodies: a
5 MB frame under a 4 MiB limit gets a 413 error frame and never reaches a replica; the socket stays
open and serves the next frame."""

from __future__ import annotations

import json

from gateway_harness import FakeReplica
from protocols_support import ProtocolGateway, auth, protocol_config
from websockets.sync.client import connect

LIMIT = 4 * 1024 * 1024


def request_frame(request_id: str, prompt_bytes: int) -> str:
    body = {"model": "tiny", "prompt": "x" * prompt_bytes, "max_tokens": 1}
    return json.dumps({"type": "completions", "id": request_id, "body": body})


def receive_until_done(socket) -> dict:
    frame = json.loads(socket.recv(timeout=60))
    while frame["type"] == "delta":
        frame = json.loads(socket.recv(timeout=60))
    return frame


def test_a_frame_over_max_body_bytes_is_refused_with_413(tmp_path):
    replica = FakeReplica("r").start()
    gateway = ProtocolGateway(protocol_config([replica.url], limits={"max_body_bytes": LIMIT}), tmp_path).start()
    try:
        with connect(gateway.ws_url, additional_headers=auth(), max_size=None) as socket:
            too_large = request_frame("big", 5_000_000)
            assert len(too_large) > LIMIT
            socket.send(too_large)
            frame = json.loads(socket.recv(timeout=60))
            assert frame == {
                "type": "error",
                "id": None,
                "status": 413,
                "error": {
                    "message": f"The frame is larger than {LIMIT} bytes (limits.max_body_bytes).",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "request_too_large",
                },
            }
            assert replica.requests == []

            just_under = request_frame("under", LIMIT - 200)
            assert len(just_under) <= LIMIT
            socket.send(just_under)
            assert receive_until_done(socket)["type"] == "final"
            assert len(replica.requests) == 1 and len(replica.requests[0]["prompt"]) == LIMIT - 200
    finally:
        gateway.stop()
        replica.stop()
