"""Every field the gateway reads from a request body is validated before use, on every entry point
(HTTP proxy routes, WebSocket, async jobs, Batch API lines, gRPC): a wrong type answers 400 in
OpenAI's shape with `param` naming the field, the replica never sees the request, and unknown
fields still reach the replica unchanged. One real gateway (all protocol extensions) over a fake
replica that records what it receives."""

from __future__ import annotations

import io
import json

import grpc
import httpx
import pytest
from gateway_harness import FakeReplica, free_port
from protocols_support import KEY, ProtocolGateway, auth, protocol_config
from websockets.sync.client import connect

from ember.gateway.proto.ember.v1 import inference_pb2 as pb
from ember.gateway.proto.ember.v1 import inference_pb2_grpc as pb_grpc

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
BODIES = {"chat/completions": CHAT, "completions": COMPLETION}

# (endpoint, field overrides, the param the 400 names); one row per wrong type of each read field.
WRONG_TYPES = [
    ("completions", {"model": 3}, "model"),
    ("completions", {"model": ""}, "model"),
    ("chat/completions", {"model": None}, "model"),
    ("completions", {"n": "2"}, "n"),
    ("chat/completions", {"n": True}, "n"),
    ("completions", {"n": 1.5}, "n"),
    ("completions", {"best_of": "2"}, "best_of"),
    ("completions", {"max_tokens": "10"}, "max_tokens"),
    ("chat/completions", {"max_tokens": 2.5}, "max_tokens"),
    ("chat/completions", {"max_completion_tokens": [1]}, "max_completion_tokens"),
    ("completions", {"prompt": 5}, "prompt"),
    ("completions", {"prompt": [1, "a"]}, "prompt"),
    ("completions", {"prompt": {"text": "hi"}}, "prompt"),
    ("chat/completions", {"messages": "hi"}, "messages"),
    ("chat/completions", {"messages": [{"content": "hi"}]}, "messages.0.role"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ("chat/completions", {"priority": "1"}, "priority"),
    ("completions", {"user": 1}, "user"),
]
# The WebSocket sets stream and stream_options itself, so only the other entry points see these.
STREAM_WRONG_TYPES = [
    ("chat/completions", {"stream": True, "stream_options": "include_usage"}, "stream_options"),
    ("completions", {"stream": True, "stream_options": [1]}, "stream_options"),
    ("completions", {"stream": "true"}, "stream"),
]


@pytest.fixture(scope="module")
def replica():
    replica = FakeReplica("r").start()
    yield replica
    replica.stop()


@pytest.fixture(scope="module")
def gateway(replica, tmp_path_factory):
    gateway = ProtocolGateway(
        protocol_config([replica.url]), tmp_path_factory.mktemp("gateway"), grpc_port=free_port()
    ).start()
    yield gateway
    gateway.stop()


def assert_openai_error(error: dict, param: str) -> None:
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert param.split(".")[0] in error["message"] and "Traceback" not in error["message"]


def post_http(gateway, endpoint: str, body: dict) -> tuple[int, dict]:
    response = httpx.post(f"{gateway.url}/v1/{endpoint}", headers=auth(), json=body, timeout=30)
    assert response.headers["content-type"].startswith("application/json")
    return response.status_code, response.json()["error"]


def post_ws(gateway, endpoint: str, body: dict) -> tuple[int, dict]:
    kind = {"chat/completions": "chat.completions", "completions": "completions"}[endpoint]
    with connect(gateway.ws_url, additional_headers=auth()) as socket:
        socket.send(json.dumps({"type": kind, "id": "r1", "body": body}))
        frame = json.loads(socket.recv(timeout=30))
    assert (frame["type"], frame["id"]) == ("error", "r1")
    return frame["status"], frame["error"]


def post_async(gateway, endpoint: str, body: dict) -> tuple[int, dict]:
    response = httpx.post(f"{gateway.url}/v1/async/{endpoint}", headers=auth(), json=body, timeout=30)
    return response.status_code, response.json()["error"]


def post_batch_line(gateway, endpoint: str, body: dict) -> tuple[int, dict]:
    line = {"custom_id": "a", "method": "POST", "url": f"/v1/{endpoint}", "body": body}
    response = httpx.post(
        f"{gateway.url}/v1/files",
        headers=auth(),
        data={"purpose": "batch"},
        files={"file": ("batch.jsonl", io.BytesIO(json.dumps(line).encode()))},
        timeout=30,
    )
    status, error = response.status_code, response.json()["error"]
    assert error["message"].startswith("Line 1 of the batch file: in 'body', ")
    assert error["param"].startswith("body.")
    return status, {**error, "param": error["param"].removeprefix("body.")}


ENTRY_POINTS = {"http": post_http, "ws": post_ws, "async": post_async, "batch": post_batch_line}


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
@pytest.mark.parametrize(("endpoint", "fields", "param"), WRONG_TYPES + STREAM_WRONG_TYPES)
def test_a_wrong_type_is_a_400_naming_the_field(gateway, replica, entry_point, endpoint, fields, param):
    if entry_point == "ws" and ("stream" in fields or "stream_options" in fields):
        pytest.skip("the WebSocket always streams: it sets stream and stream_options itself")
    received_before = len(replica.requests)
    status, error = ENTRY_POINTS[entry_point](gateway, endpoint, {**BODIES[endpoint], **fields})
    assert status == 400
    assert_openai_error(error, param)
    assert len(replica.requests) == received_before


def test_the_stream_options_crash_is_a_400(gateway):
    """The original report: a string stream_options with stream true was a plain-text 500."""
    status, error = post_http(gateway, "chat/completions", {**CHAT, "stream": True, "stream_options": "yes"})
    assert status == 400
    assert error["message"] == "stream_options: must be a JSON object."


def test_unknown_fields_pass_through_to_the_replica(gateway, replica):
    extra = {"temperature": 0.25, "vendor_extension": {"nested": [1, "two"]}, "stream_options": {"x": 1}}
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions", headers=auth(), json={**CHAT, **extra, "stream": True}, timeout=30
    )
    assert response.status_code == 200
    forwarded = replica.requests[-1]
    assert forwarded["temperature"] == 0.25
    assert forwarded["vendor_extension"] == {"nested": [1, "two"]}
    assert forwarded["stream_options"] == {"x": 1, "include_usage": True}


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_a_non_finite_number_is_named_not_reported_as_bad_json(gateway, literal):
    raw = b'{"model": "tiny", "prompt": "hi", "temperature": ' + literal.encode() + b"}"
    response = httpx.post(
        f"{gateway.url}/v1/completions",
        headers={**auth(), "content-type": "application/json"},
        content=raw,
        timeout=30,
    )
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "temperature: must be a finite number",
        "type": "invalid_request_error",
        "param": "temperature",
        "code": None,
    }


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/async/chat/completions"])
def test_json_nested_past_the_parsers_limit_is_a_400(gateway, path):
    """Found by fuzzing: 1,025 nested arrays made the NaN check's second parse raise RecursionError (a 500)."""
    raw = b"[" * 1025 + b"]" * 1025
    response = httpx.post(
        gateway.url + path, headers={**auth(), "content-type": "application/json"}, content=raw, timeout=30
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_grpc_checks_the_same_fields(gateway, replica):
    received_before = len(replica.requests)
    chat = pb.ChatInput(messages=[pb.ChatMessage(role="user", content="hi")])
    with grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
        stub = pb_grpc.InferenceStub(channel)
        metadata = [("authorization", f"Bearer {KEY}")]
        for request, message in [
            (pb.GenerateRequest(model="tiny", chat=chat, temperature=float("nan")), "temperature: must be a finite number"),
            (pb.GenerateRequest(model="tiny", prompt="hi", top_p=float("inf")), "top_p: must be a finite number"),
            (pb.GenerateRequest(model="", prompt="hi"), "model: String should have at least 1 character"),
        ]:
            with pytest.raises(grpc.RpcError) as caught:
                stub.Complete(request, metadata=metadata, timeout=30)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert caught.value.details().startswith(message)
    assert len(replica.requests) == received_before
