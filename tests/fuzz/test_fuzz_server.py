"""Property-based fuzz of every public route of `ember serve`: whatever a client sends, the answer is
a 2xx/4xx (4xx in OpenAI's error shape), never a 5xx or a hang, and the server lives on."""

from __future__ import annotations

import pytest
from fuzz_requests import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    DETOKENIZE_FIELDS,
    METHODS,
    QUERIES,
    RAW_BODIES,
    TOKENIZE_FIELDS,
    FuzzRequest,
    fuzz_settings,
    headers,
    json_body,
    paths,
    send_and_check,
)
from fuzz_targets import SERVER_KEY, FuzzTarget
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

JSON_ROUTES = {
    "/v1/chat/completions": CHAT_FIELDS,
    "/v1/completions": COMPLETION_FIELDS,
    "/tokenize": TOKENIZE_FIELDS,
    "/detokenize": DETOKENIZE_FIELDS,
}
GET_ROUTES = ["/v1/models", "/health", "/ready", "/version", "/metrics"]


@st.composite
def json_requests(draw: st.DrawFn) -> FuzzRequest:
    path = draw(st.sampled_from(sorted(JSON_ROUTES)))
    return FuzzRequest("POST", path, draw(json_body(JSON_ROUTES[path])), draw(headers(SERVER_KEY)))


@st.composite
def any_requests(draw: st.DrawFn) -> FuzzRequest:
    method = draw(METHODS)
    path = draw(paths([*JSON_ROUTES, *GET_ROUTES]))
    body = draw(st.none() | RAW_BODIES)
    return FuzzRequest(method, path, body, draw(headers(SERVER_KEY)), draw(QUERIES))


@fuzz_settings
@given(request=json_requests())
def test_request_bodies(fuzz_server: FuzzTarget, request: FuzzRequest) -> None:
    send_and_check(fuzz_server.client, request)


@fuzz_settings
@given(request=any_requests())
def test_methods_paths_queries_and_raw_bodies(fuzz_server: FuzzTarget, request: FuzzRequest) -> None:
    send_and_check(fuzz_server.client, request)


def test_server_alive_after_fuzzing(fuzz_server: FuzzTarget) -> None:
    fuzz_server.assert_alive()
    valid = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
    answer = fuzz_server.client.post("/v1/completions", json=valid, headers={"authorization": f"Bearer {SERVER_KEY}"})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
