"""Structured output over HTTP with the official openai SDK and the real SmolLM2: every answer parses and
validates against its schema (jsonschema), streamed or not; bad constraints are 400s naming the field."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from tests.structured.conftest import MODEL_NAME
from tests.structured.schemas import SCHEMAS

PROMPT = "Reply with a JSON object that fits the requested format. Make up plausible values."


def _client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_parse_twenty_pydantic_schemas(smollm2_server):
    """client.beta.chat.completions.parse sends response_format json_schema (strict); each of the 20 answers
    parses into its model and validates against the schema the SDK sent."""

    async def one(client, model):
        completion = await client.beta.chat.completions.parse(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": f"{PROMPT} ({model.__name__})"}],
            response_format=model,
            max_tokens=200,
            temperature=0,
        )
        return completion.choices[0]

    async def run():
        async with _client(smollm2_server) as client:
            return await asyncio.gather(*(one(client, model) for model in SCHEMAS))

    choices = asyncio.run(run())
    for model, choice in zip(SCHEMAS, choices, strict=True):
        assert choice.finish_reason == "stop", (model.__name__, choice.message.content)
        assert isinstance(choice.message.parsed, model)
        jsonschema.validate(json.loads(choice.message.content), model.model_json_schema())


def test_streamed_parse_of_twenty_pydantic_schemas(smollm2_server):
    """The SDK's stream helper with a pydantic response_format: the content deltas join to valid JSON and the
    final message parses into the model, for each of the 20 schemas."""

    async def one(client, model):
        deltas = []
        async with client.chat.completions.stream(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": f"{PROMPT} ({model.__name__})"}],
            response_format=model,
            max_tokens=200,
            temperature=0,
        ) as stream:
            async for event in stream:
                if event.type == "content.delta":
                    deltas.append(event.delta)
            final = await stream.get_final_completion()
        return deltas, final.choices[0]

    async def run():
        async with _client(smollm2_server) as client:
            return await asyncio.gather(*(one(client, model) for model in SCHEMAS))

    for model, (deltas, choice) in zip(SCHEMAS, asyncio.run(run()), strict=True):
        assert choice.finish_reason == "stop", (model.__name__, choice.message.content)
        assert len(deltas) > 1 and "".join(deltas) == choice.message.content
        jsonschema.validate(json.loads(choice.message.content), model.model_json_schema())
        assert isinstance(choice.message.parsed, model)


def test_completions_and_vllm_fields(smollm2_server):
    """/v1/completions takes response_format too; vLLM's guided_* and structured_outputs constrain alike."""
    url = f"{smollm2_server.url}/v1"
    cases = [
        (
            "completions",
            {"response_format": {"type": "json_object"}},
            lambda text: isinstance(json.loads(text), dict),
        ),
        (
            "chat/completions",
            {"response_format": {"type": "json_object"}},
            lambda text: isinstance(json.loads(text), dict),
        ),
        ("completions", {"guided_choice": ["cat", "dog"]}, lambda text: text in ("cat", "dog")),
        (
            "chat/completions",
            {"guided_regex": r"[0-9]{3}-[a-z]{2}"},
            lambda text: len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha(),
        ),
        (
            "chat/completions",
            {"structured_outputs": {"choice": ["yes", "no"]}},
            lambda text: text in ("yes", "no"),
        ),
        (
            "chat/completions",
            {"guided_json": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}},
            lambda text: isinstance(json.loads(text)["n"], int),
        ),
        (
            "completions",
            {"guided_grammar": 'root ::= "A" [0-9] [0-9]'},
            lambda text: len(text) == 3 and text[0] == "A" and text[1:].isdigit(),
        ),
    ]
    for path, fields, check in cases:
        body = {"model": MODEL_NAME, "max_tokens": 60, "temperature": 0, **fields}
        if path == "completions":
            # A prompt that asks for an object: on "Answer: " SmolLM2's greedy JSON repeats one key past
            # max_tokens under some CPUs' numerics (float32 with int8 activations on AVX2).
            body["prompt"] = "A JSON object: " if "response_format" in fields else "Answer: "
        else:
            body["messages"] = [{"role": "user", "content": "Answer."}]
        response = httpx.post(f"{url}/{path}", json=body, timeout=120)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        text = choice["text"] if path == "completions" else choice["message"]["content"]
        assert choice["finish_reason"] == "stop", (fields, text)
        assert check(text), (fields, text)


def test_n_siblings_each_follow_the_grammar(smollm2_server):
    response = httpx.post(
        f"{smollm2_server.url}/v1/chat/completions",
        json={
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "Pick a color."}],
            "n": 4,
            "temperature": 1.0,
            "seed": 7,
            "max_tokens": 10,
            "guided_choice": ["red", "green", "blue"],
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text
    texts = [choice["message"]["content"] for choice in response.json()["choices"]]
    assert len(texts) == 4 and set(texts) <= {"red", "green", "blue"}


@pytest.mark.parametrize(
    "fields, param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"guided_regex": "([a-z"}, "guided_regex"),
        ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ],
)
def test_invalid_constraints_are_400_naming_the_field(smollm2_server, fields, param):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **fields}
    response = httpx.post(f"{smollm2_server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert set(error) == {"message", "type", "param", "code"}
