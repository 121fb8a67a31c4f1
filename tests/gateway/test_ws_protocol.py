"""GET /v1/ws with the `websockets` client against the real gateway and a real `ember serve` replica:
multiplexed requests, cancel, auth by header or frame, and error frames that keep the socket open."""

from __future__ import annotations

import json

import pytest
from gateway_harness import sha256, wait_until
from protocols_support import (
    KEY,
    ProtocolGateway,
    auth,
    protocol_config,
    real_replica,  # noqa: F401 - fixture
    replica_metric,
)
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

SLOW_KEY = "sk-test-ws-slow"


@pytest.fixture
def gateway(real_replica, tmp_path):  # noqa: F811
    config = protocol_config([real_replica])
    config["keys"]["inline"].append({"name": "slow", "sha256": sha256(SLOW_KEY), "rpm": 1})
    gateway = ProtocolGateway(config, tmp_path).start()
    yield gateway
    gateway.stop()


def receive(socket) -> dict:
    return json.loads(socket.recv(timeout=60))


def test_two_multiplexed_requests_and_a_cancel(gateway, real_replica):  # noqa: F811
    generated_before = replica_metric(real_replica, "vllm:generation_tokens_total")
    with connect(gateway.ws_url, additional_headers=auth()) as socket:
        long_body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Tell me a long story"}],
            "max_tokens": 900,
            "ignore_eos": True,
        }
        socket.send(json.dumps({"type": "chat.completions", "id": "long", "body": long_body}))
        socket.send(
            json.dumps(
                {
                    "type": "completions",
                    "id": "short",
                    "body": {"model": "tiny", "prompt": "Once upon", "max_tokens": 5, "ignore_eos": True},
                }
            )
        )
        frames: dict[str, list[dict]] = {"long": [], "short": []}
        cancelled = False
        while not (cancelled and frames["short"] and frames["short"][-1]["type"] == "final"):
            frame = receive(socket)
            assert frame["type"] in ("delta", "final", "cancelled"), frame
            frames[frame["id"]].append(frame)
            if frame["id"] == "long" and frame["type"] == "delta" and len(frames["long"]) == 1:
                socket.send(json.dumps({"type": "cancel", "id": "long"}))
            cancelled = cancelled or frame["type"] == "cancelled"

        short = frames["short"]
        assert [f["type"] for f in short] == ["delta"] * (len(short) - 1) + ["final"]
        assert short[-1]["usage"]["completion_tokens"] == 5
        assert short[-1]["finish_reasons"] == ["length"]
        text = "".join(f["data"]["choices"][0]["text"] for f in short[:-1])
        assert text and all(f["data"]["object"] == "text_completion" for f in short[:-1])

        long = frames["long"]
        assert long[0]["type"] == "delta" and long[0]["data"]["object"] == "chat.completion.chunk"
        assert long[-1] == {"type": "cancelled", "id": "long"}
        assert "final" not in [f["type"] for f in long]
        # The cancel reached the replica: it aborted the 900-token generation instead of finishing it.
        running = "vllm:num_requests_running"
        wait_until(
            lambda: replica_metric(real_replica, running) == 0, timeout_s=60, what="the replica to stop"
        )
        assert replica_metric(real_replica, "vllm:generation_tokens_total") - generated_before < 900 + 5

        # The socket stays usable for the same id after the cancel.
        socket.send(
            json.dumps(
                {
                    "type": "completions",
                    "id": "long",
                    "body": {"model": "tiny", "prompt": "x", "max_tokens": 2},
                }
            )
        )
        frame = receive(socket)
        while frame["type"] == "delta":
            frame = receive(socket)
        assert (frame["type"], frame["id"], frame["usage"]["completion_tokens"]) == ("final", "long", 2)


def test_auth_frame_and_malformed_frames_get_error_frames(gateway):
    with connect(gateway.ws_url) as socket:

        def error_for(message: str | bytes) -> dict:
            socket.send(message)
            frame = receive(socket)
            assert frame["type"] == "error", frame
            return frame

        request = {
            "type": "completions",
            "id": "r1",
            "body": {"model": "tiny", "prompt": "a", "max_tokens": 1},
        }
        frame = error_for(json.dumps(request))
        assert (frame["id"], frame["status"], frame["error"]["code"]) == ("r1", 401, "missing_api_key")
        frame = error_for(json.dumps({"type": "auth", "api_key": "sk-wrong"}))
        assert (frame["status"], frame["error"]["code"]) == (401, "invalid_api_key")
        socket.send(json.dumps({"type": "auth", "api_key": KEY}))
        assert receive(socket) == {"type": "auth.ok"}

        frame = error_for("not json")
        assert (frame["id"], frame["status"], frame["error"]["code"]) == (None, 400, "invalid_frame")
        assert set(frame["error"]) == {"message", "type", "param", "code"}
        assert error_for(b"[1, 2]")["error"]["message"] == "A frame must be a JSON object."
        assert error_for(json.dumps({"type": "embeddings", "id": "e"}))["error"]["param"] == "type"
        assert error_for(json.dumps({"type": ["completions"], "id": "e"}))["error"]["param"] == "type"  # found by fuzzing
        assert error_for(json.dumps({**request, "id": ""}))["error"]["param"] == "id"
        assert error_for(json.dumps({**request, "body": "text"}))["error"]["param"] == "body"
        assert error_for(json.dumps({**request, "priority": "high"}))["error"]["param"] == "priority"
        frame = error_for(json.dumps({"type": "cancel", "id": "nothing"}))
        assert (frame["id"], frame["error"]["code"]) == ("nothing", "unknown_request")
        frame = error_for(json.dumps({**request, "body": {"model": "nope", "prompt": "a"}}))
        assert (frame["id"], frame["status"], frame["error"]["code"]) == ("r1", 404, "model_not_found")
        frame = error_for(json.dumps({**request, "body": {"model": "tiny", "prompt": "a", "max_tokens": -1}}))
        assert (frame["id"], frame["status"]) == ("r1", 400)

        socket.send(json.dumps(request))
        frames = [receive(socket)]
        while frames[-1]["type"] == "delta":
            frames.append(receive(socket))
        assert frames[-1]["type"] == "final" and frames[-1]["usage"]["completion_tokens"] == 1


def test_rate_limited_request_gets_429_frame_with_headers(gateway):
    request = {"type": "completions", "body": {"model": "tiny", "prompt": "a", "max_tokens": 1}}
    with connect(gateway.ws_url, additional_headers=auth(SLOW_KEY)) as socket:
        socket.send(json.dumps({**request, "id": "first"}))
        frame = receive(socket)
        while frame["type"] == "delta":
            frame = receive(socket)
        assert (frame["type"], frame["id"]) == ("final", "first")
        socket.send(json.dumps({**request, "id": "second"}))
        frame = receive(socket)
    assert (frame["type"], frame["id"], frame["status"]) == ("error", "second", 429)
    assert int(frame["headers"]["retry-after"]) >= 1
    assert frame["headers"]["x-ratelimit-limit-requests"] == "1"


def test_bad_authorization_header_closes_with_policy_violation(gateway):
    with connect(gateway.ws_url, additional_headers={"authorization": "Bearer sk-wrong"}) as socket:
        frame = receive(socket)
        assert (frame["type"], frame["status"], frame["error"]["code"]) == ("error", 401, "invalid_api_key")
        with pytest.raises(ConnectionClosed) as closed:
            socket.recv(timeout=10)
    assert closed.value.rcvd.code == 1008
