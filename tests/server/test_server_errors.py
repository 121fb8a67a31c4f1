"""Every bad request gets OpenAI's error shape with the exact status; never a 500 or a traceback."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from ember.engine.errors import (
    EngineDeadError,
    EngineRequestError,
    InvalidSamplingParamsError,
    PromptTooLongError,
)
from ember.server.errors import engine_error

MODEL_NAME = "tiny"
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}


def assert_error(
    response: httpx.Response, status: int, code: str | None = None, param: str | None = None
) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


@pytest.fixture(scope="module")
def post(server, auth):
    def post(path: str, **kwargs) -> httpx.Response:
        return httpx.post(
            f"{server.url}{path}", headers={**auth, **kwargs.pop("headers", {})}, timeout=30, **kwargs
        )

    return post


def test_bad_json_is_400(post):
    error = assert_error(
        post(
            "/v1/chat/completions",
            content=b'{"model": "tiny", "messages": [',
            headers={"content-type": "application/json"},
        ),
        400,
        code="invalid_json",
    )
    assert "JSON" in error["message"]
    assert_error(
        post("/v1/completions", content=b"not json", headers={"content-type": "application/json"}), 400
    )
    assert_error(post("/v1/completions", content=b"", headers={"content-type": "application/json"}), 400)


@pytest.mark.parametrize(
    "path, text_field",
    [
        ("/v1/completions", '"prompt": "\\ud800"'),
        ("/v1/completions", '"prompt": ["ok", "\\udfff"]'),
        ("/v1/chat/completions", '"messages": [{"role": "user", "content": "\\ud800"}]'),
        ("/v1/chat/completions", '"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]'),
        ("/v1/chat/completions", '"messages": [{"role": "user", "name": "\\ud800", "content": "hi"}]'),
        ("/tokenize", '"prompt": "\\ud800"'),
    ],
)
def test_lone_surrogates_are_400(post, path, text_field):
    # Valid JSON escapes that no tokenizer can encode: these were 500s (found by fuzzing).
    body = f'{{"model": "{MODEL_NAME}", "max_tokens": 2, {text_field}}}'
    error = assert_error(post(path, content=body, headers={"content-type": "application/json"}), 400)
    assert "lone surrogate" in error["message"]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {**CHAT, "max_tokens": "many"}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "messages": "hello"}, "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ("/v1/completions", {**COMPLETION, "temperature": "hot"}, "temperature"),
        ("/v1/completions", {**COMPLETION, "prompt": {"text": "x"}}, "prompt"),
        ("/v1/completions", {"model": MODEL_NAME}, "prompt"),
        ("/v1/completions", [1, 2, 3], None),
    ],
)
def test_wrong_types_are_400(post, path, body, param):
    # vLLM answers 400 (not FastAPI's 422) for a body that does not validate.
    assert_error(post(path, json=body), 400, param=param)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {**COMPLETION, "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {**COMPLETION, "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {**COMPLETION, "temperature": -0.5}, "temperature"),
        ("/v1/completions", {**COMPLETION, "temperature": 1e9}, "temperature"),
        ("/v1/completions", {**COMPLETION, "top_p": 0}, "top_p"),
        ("/v1/completions", {**COMPLETION, "top_p": 1.5}, "top_p"),
        ("/v1/completions", {**COMPLETION, "n": 0}, "n"),
        ("/v1/completions", {**COMPLETION, "n": 100000}, "n"),
        ("/v1/completions", {**COMPLETION, "logprobs": 1000}, "logprobs"),
        ("/v1/completions", {**COMPLETION, "presence_penalty": 5}, "presence_penalty"),
        ("/v1/completions", {**COMPLETION, "min_p": -1}, "min_p"),
        ("/v1/completions", {**COMPLETION, "seed": 2**70}, "seed"),
        ("/v1/completions", {**COMPLETION, "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ("/v1/completions", {**COMPLETION, "prompt": []}, None),
        ("/v1/completions", {**COMPLETION, "prompt": [1, 2, 10**9]}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": ""}, "prompt"),
        ("/v1/completions", {**COMPLETION, "best_of": 3}, None),
        ("/v1/completions", {**COMPLETION, "stop": [""]}, "stop"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 3}, None),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 50, "logprobs": True}, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -3}, "max_completion_tokens"),
        ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                                  "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ("/v1/chat/completions", {**CHAT, "tool_choice": "auto"}, "tool_choice"),
    ],
)
def test_negative_or_absurd_parameters_are_400(post, path, body, param):
    assert_error(post(path, json=body), 400, param=param)


@pytest.mark.parametrize(
    "field, raw_value",
    [("temperature", "NaN"), ("temperature", '"NaN"'), ("top_p", "Infinity"), ("presence_penalty", "-Infinity")],
)
def test_non_finite_numbers_are_named_as_such(post, field, raw_value):
    """NaN used to fail the range check and read "must be <= 100"; the message says what is wrong."""
    content = f'{{"model": "{MODEL_NAME}", "prompt": "hi", "max_tokens": 2, "{field}": {raw_value}}}'
    error = assert_error(
        post("/v1/completions", content=content.encode(), headers={"content-type": "application/json"}),
        400,
        param=field,
    )
    assert error["message"] == f"{field}: must be a finite number"


def test_empty_messages_is_400(post):
    error = assert_error(post("/v1/chat/completions", json={**CHAT, "messages": []}), 400, param="messages")
    assert "at least 1" in error["message"]


def test_unknown_model_is_404(post):
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        error = assert_error(
            post(path, json={**body, "model": "gpt-17"}), 404, code="model_not_found", param="model"
        )
        assert "gpt-17" in error["message"]


def test_prompt_plus_max_tokens_over_context_is_400(post):
    error = assert_error(
        post("/v1/completions", json={**COMPLETION, "max_tokens": 1024}), 400, code="context_length_exceeded"
    )
    assert "1024" in error["message"]
    long_prompt = list(range(5, 5 + 1100))
    assert_error(
        post("/v1/completions", json={**COMPLETION, "prompt": long_prompt}),
        400,
        code="context_length_exceeded",
    )
    assert_error(
        post("/v1/chat/completions", json={**CHAT, "max_tokens": 5000}), 400, code="context_length_exceeded"
    )


def test_engine_refusals_are_400s_naming_the_field(post, server, auth, tiny_model_dir):
    """The engine checks prompts and sampling parameters; the server answers its typed errors as these."""
    vocab_size = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    limit = httpx.get(f"{server.url}/v1/models", headers=auth).json()["data"][0]["max_model_len"]
    out_of_range = f"Token id {10**9} is out of range (vocabulary size {vocab_size})"
    error = assert_error(
        post("/v1/completions", json={**COMPLETION, "prompt": [1, 10**9 - 1, 10**9]}), 400, param="prompt"
    )
    assert error["message"] == out_of_range
    error = assert_error(post("/detokenize", json={"tokens": [10**9, 5]}), 400, param="tokens")
    assert error["message"] == out_of_range
    error = assert_error(post("/v1/completions", json={**COMPLETION, "prompt": ""}), 400, param="prompt")
    assert error["message"] == "The prompt is empty (it encodes to zero tokens)"
    error = assert_error(
        post("/v1/completions", json={**COMPLETION, "prompt": [5] * limit}),
        400,
        code="context_length_exceeded",
        param="prompt",
    )
    assert error["message"] == (
        f"This model's maximum context length is {limit} tokens. However, your prompt has {limit} tokens, "
        "which leaves no room for the completion. Please shorten the prompt."
    )
    long_chat = {**CHAT, "messages": [{"role": "user", "content": "hi " * limit}]}
    error = assert_error(
        post("/v1/chat/completions", json=long_chat), 400, code="context_length_exceeded", param="messages"
    )
    assert error["message"].startswith(f"This model's maximum context length is {limit} tokens.")
    error = assert_error(
        post("/v1/completions", json={**COMPLETION, "min_tokens": 5, "max_tokens": 2}),
        400,
        param="min_tokens",
    )
    assert error["message"] == "min_tokens must be <= max_tokens (2), got 5"


@pytest.mark.parametrize(
    "error, status, error_type, code, param",
    [
        (
            PromptTooLongError("too long", "messages"),
            400,
            "invalid_request_error",
            "context_length_exceeded",
            "messages",
        ),
        (
            InvalidSamplingParamsError("top_p must be in (0, 1]", "top_p"),
            400,
            "invalid_request_error",
            None,
            "top_p",
        ),
        (EngineRequestError("step failed"), 500, "server_error", "engine_error", None),
        (EngineDeadError("gone"), 503, "service_unavailable_error", "engine_dead", None),
    ],
)
def test_engine_errors_map_to_one_openai_error_each(error, status, error_type, code, param):
    api_error = engine_error(error)
    assert api_error.status == status
    assert api_error.body()["error"] == {
        "message": api_error.message,
        "type": error_type,
        "param": param,
        "code": code,
    }
    assert str(error) in api_error.message


def test_oversize_body_is_413(post):
    huge = {**COMPLETION, "prompt": "x" * 70_000}  # the shared server's limit is 64 KiB
    assert_error(post("/v1/completions", json=huge), 413, code="request_too_large")

    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(80):
            yield b"y" * 1000
        yield b'"}'

    # No Content-Length: the limit is enforced while the body streams in.
    assert_error(post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413)


def test_missing_or_wrong_api_key_is_401(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "test-key"}):
        response = httpx.post(f"{server.url}/v1/completions", json=COMPLETION, headers=headers)
        assert_error(response, 401, code="invalid_api_key")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as raised:
        client.models.list()
    assert raised.value.status_code == 401
    # Probes stay open: load balancers and Prometheus carry no key.
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_unknown_path_and_method_are_json(server, auth):
    assert_error(httpx.get(f"{server.url}/v1/nothing", headers=auth), 404)
    assert_error(httpx.get(f"{server.url}/v1/completions", headers=auth), 405)


def test_sdk_raises_bad_request_with_the_message(server, api_key):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=100_000)
    assert raised.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
