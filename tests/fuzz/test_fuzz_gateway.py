"""Property-based fuzz of every public route of `ember gateway` (a real process in front of a real
tiny replica): the proxy routes, async jobs, files, batches, the admin API, the read-only routes and
the WebSocket. Every answer is a 2xx/4xx (4xx in OpenAI's error shape), never a 5xx or a hang, and
the gateway lives on."""

from __future__ import annotations

import json

import pytest
from fuzz_requests import (
    ADMIN_KEY_FIELDS,
    ASYNC_FIELDS,
    BATCH_FIELDS,
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    JUNK,
    METHODS,
    QUERIES,
    RAW_BODIES,
    REQUEST_TIMEOUT_S,
    TEXT,
    FuzzRequest,
    answer_problem,
    fuzz_settings,
    headers,
    json_body,
    json_object,
    paths,
    send_and_check,
    to_json,
)
from fuzz_targets import ADMIN_KEY, GATEWAY_KEY, FuzzTarget
from hypothesis import given
from hypothesis import strategies as st
from websockets.sync.client import connect

pytestmark = pytest.mark.slow


def without_known_crash(fields: dict) -> st.SearchStrategy[bytes]:
    near_valid = json_object(fields).map(to_json)
    return st.one_of(near_valid, near_valid, RAW_BODIES)


# route -> (body fields, the key that may call it)
JSON_ROUTES = {
    "/v1/chat/completions": (CHAT_FIELDS, GATEWAY_KEY),
    "/v1/completions": (COMPLETION_FIELDS, GATEWAY_KEY),
    "/v1/async/chat/completions": ({**CHAT_FIELDS, **ASYNC_FIELDS}, GATEWAY_KEY),
    "/v1/async/completions": ({**COMPLETION_FIELDS, **ASYNC_FIELDS}, GATEWAY_KEY),
    "/v1/batches": (BATCH_FIELDS, GATEWAY_KEY),
    "/admin/keys": (ADMIN_KEY_FIELDS, ADMIN_KEY),
}
OTHER_ROUTES = [
    "/health", "/ready", "/metrics", "/v1/models", "/v1/usage", "/v1/files", "/v1/files/file-x",
    "/v1/files/file-x/content", "/v1/batches/batch_x", "/v1/batches/batch_x/cancel", "/v1/async/jobs/job_x",
    "/v1/async/webhook-secret", "/admin/keys/fuzz", "/admin/replicas",
]  # fmt: skip


@st.composite
def json_requests(draw: st.DrawFn) -> FuzzRequest:
    path = draw(st.sampled_from(sorted(JSON_ROUTES)))
    fields, key = JSON_ROUTES[path]
    body = draw(without_known_crash(fields) if path.endswith("completions") else json_body(fields))
    return FuzzRequest("POST", path, body, draw(headers(key)))


@st.composite
def any_requests(draw: st.DrawFn) -> FuzzRequest:
    method = draw(METHODS)
    path = draw(paths([*JSON_ROUTES, *OTHER_ROUTES]))
    key = ADMIN_KEY if path.startswith("/admin") else GATEWAY_KEY
    return FuzzRequest(method, path, draw(st.none() | RAW_BODIES), draw(headers(key)), draw(QUERIES))


@fuzz_settings
@given(request=json_requests())
def test_request_bodies(fuzz_gateway: FuzzTarget, request: FuzzRequest) -> None:
    send_and_check(fuzz_gateway.client, request)


@fuzz_settings
@given(request=any_requests())
def test_methods_paths_queries_and_raw_bodies(fuzz_gateway: FuzzTarget, request: FuzzRequest) -> None:
    send_and_check(fuzz_gateway.client, request)


FORM_TEXT = st.text(max_size=24)  # no lone surrogates: httpx cannot encode them into a form
JSONL = st.lists(st.one_of(JUNK.map(to_json), st.binary(max_size=40)), max_size=4).map(b"\n".join)


@fuzz_settings
@given(purpose=st.none() | st.sampled_from(["batch", "fine-tune"]) | FORM_TEXT, content=JSONL, filename=FORM_TEXT)
def test_file_uploads(fuzz_gateway: FuzzTarget, purpose: str | None, content: bytes, filename: str) -> None:
    request = FuzzRequest("POST", "/v1/files")
    data = {} if purpose is None else {"purpose": purpose}
    response = fuzz_gateway.client.post(
        "/v1/files", data=data, files={"file": (filename, content)}, timeout=REQUEST_TIMEOUT_S,
        headers={"authorization": f"Bearer {GATEWAY_KEY}"},
    )  # fmt: skip
    problem = answer_problem(response, request)
    assert problem is None, problem


WS_FRAME = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["chat.completions", "completions", "cancel", "auth", "nope"]) | JUNK},
        optional={"id": TEXT | JUNK, "body": st.fixed_dictionaries({"model": st.just("tiny")}) | JUNK,
                  "priority": JUNK, "api_key": TEXT},
    ).map(to_json),
    RAW_BODIES,
)  # fmt: skip
WS_FRAME_TYPES = {"auth.ok", "delta", "final", "cancelled", "error"}


@fuzz_settings
@given(frame=WS_FRAME)
def test_websocket_frames(fuzz_gateway: FuzzTarget, frame: bytes) -> None:
    """After any frame the socket still serves a valid request; every frame the gateway sends is one of
    its documented types, and its errors are in OpenAI's shape."""
    url = fuzz_gateway.url.replace("http://", "ws://") + "/v1/ws"
    probe = {"type": "completions", "id": "probe", "body": {"model": "tiny", "prompt": "Hi", "max_tokens": 1}}
    with connect(url, additional_headers={"authorization": f"Bearer {GATEWAY_KEY}"}) as socket:
        socket.send(frame.decode("utf-8", errors="replace"))
        socket.send(json.dumps(probe))
        while True:
            reply = json.loads(socket.recv(timeout=REQUEST_TIMEOUT_S))
            assert reply.get("type") in WS_FRAME_TYPES, reply
            if reply["type"] == "error":
                assert isinstance(reply["error"]["message"], str) and isinstance(reply["error"]["type"], str), reply
            if reply.get("id") == "probe" and reply["type"] in ("final", "error", "cancelled"):
                break
        assert reply["type"] == "final", reply


def test_gateway_alive_after_fuzzing(fuzz_gateway: FuzzTarget) -> None:
    fuzz_gateway.assert_alive()
    valid = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
    answer = fuzz_gateway.client.post("/v1/completions", json=valid, headers={"authorization": f"Bearer {GATEWAY_KEY}"})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
