"""Structured output and tool calls through the gateway to a real `ember serve` replica of the tiny model:
response_format (json_schema) and tool_choice "required" over HTTP (openai SDK, whole and streamed),
WebSocket, gRPC, an async job and Batch API lines all come back constrained, and the replica's 400s for a bad
schema, an unknown tool and a tool_choice without tools reach the client naming the parameter.

The tiny model is random: what makes its output checkable is the grammar. The schemas only have enums and
booleans, so every constrained answer ends within a few tokens and is one of a handful of valid objects."""

from __future__ import annotations

import asyncio
import io
import json

import grpc
import httpx
import jsonschema
import openai
import pytest
from gateway_harness import free_port, wait_until
from protocols_support import (
    KEY,
    ProtocolGateway,
    auth,
    protocol_config,
    real_replica,  # noqa: F401 - fixture
)
from websockets.sync.client import connect

from ember.gateway.proto.ember.v1 import inference_pb2 as pb
from ember.gateway.proto.ember.v1 import inference_pb2_grpc as pb_grpc

ANSWER = {
    "type": "object",
    "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "sunny": {"type": "boolean"}},
    "required": ["unit", "sunny"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
TOOL_SCHEMAS = {
    "set_unit": {
        "type": "object",
        "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["unit"],
        "additionalProperties": False,
    },
    "switch": {
        "type": "object",
        "properties": {"on": {"type": "boolean"}},
        "required": ["on"],
        "additionalProperties": False,
    },
}
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": schema}}
    for name, schema in TOOL_SCHEMAS.items()
]
MESSAGES = [{"role": "user", "content": "Is it sunny?"}]
STRUCTURED = {
    "model": "tiny",
    "messages": MESSAGES,
    "max_tokens": 40,
    "temperature": 0,
    "response_format": RESPONSE_FORMAT,
}
REQUIRED = {
    "model": "tiny",
    "messages": MESSAGES,
    "max_tokens": 40,
    "temperature": 0,
    "tools": TOOLS,
    "tool_choice": "required",
}
# Each refused by the replica with a 400 naming the parameter (the gateway reads none of these fields).
BAD_REQUESTS = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            }
        },
        "response_format",
    ),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
]


@pytest.fixture
def gateway(real_replica, tmp_path):  # noqa: F811
    gateway = ProtocolGateway(protocol_config([real_replica]), tmp_path, grpc_port=free_port()).start()
    yield gateway
    gateway.stop()


def assert_structured(content: str) -> None:
    jsonschema.validate(json.loads(content), ANSWER)


def assert_calls(calls: list[tuple[str, str]]) -> None:
    """(name, arguments) pairs: at least one, each one of the tools with arguments valid under its schema."""
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), TOOL_SCHEMAS[name])


def test_http_whole_and_streamed(gateway):
    async def run():
        async with openai.AsyncOpenAI(
            base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=120
        ) as client:
            structured = await client.chat.completions.create(**STRUCTURED)
            required = await client.chat.completions.create(**REQUIRED)
            streamed: dict[int, list[str]] = {}
            finish = None
            async for chunk in await client.chat.completions.create(**REQUIRED, stream=True):
                for choice in chunk.choices:
                    finish = choice.finish_reason or finish
                    for piece in choice.delta.tool_calls or []:
                        call = streamed.setdefault(piece.index, ["", ""])
                        call[0] += piece.function.name or ""
                        call[1] += piece.function.arguments or ""
            return structured.choices[0], required.choices[0], streamed, finish

    structured, required, streamed, finish = asyncio.run(run())
    assert structured.finish_reason == "stop"
    assert_structured(structured.message.content)
    assert required.finish_reason == finish == "tool_calls" and required.message.content is None
    calls = [(call.function.name, call.function.arguments) for call in required.message.tool_calls]
    assert_calls(calls)
    assert [tuple(streamed[index]) for index in sorted(streamed)] == calls


def test_websocket(gateway):
    def run(socket, request_id: str, body: dict) -> tuple[str, dict[int, list[str]], list[str]]:
        socket.send(json.dumps({"type": "chat.completions", "id": request_id, "body": body}))
        content, calls = "", {}
        while True:
            frame = json.loads(socket.recv(timeout=120))
            assert frame["id"] == request_id and frame["type"] in ("delta", "final"), frame
            if frame["type"] == "final":
                return content, calls, frame["finish_reasons"]
            for choice in frame["data"]["choices"]:
                content += choice["delta"].get("content") or ""
                for piece in choice["delta"].get("tool_calls") or []:
                    call = calls.setdefault(piece["index"], ["", ""])
                    call[0] += piece["function"].get("name") or ""
                    call[1] += piece["function"].get("arguments") or ""

    with connect(gateway.ws_url, additional_headers=auth()) as socket:
        content, _, finish_reasons = run(socket, "structured", STRUCTURED)
        assert finish_reasons == ["stop"]
        assert_structured(content)
        content, calls, finish_reasons = run(socket, "required", REQUIRED)
        assert finish_reasons == ["tool_calls"] and content == ""
        assert_calls([tuple(calls[index]) for index in sorted(calls)])


def test_grpc(gateway):
    def request(**fields) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            model="tiny",
            chat=pb.ChatInput(messages=[pb.ChatMessage(**MESSAGES[0])]),
            max_tokens=40,
            temperature=0.0,
            **fields,
        )

    metadata = [("authorization", f"Bearer {KEY}")]
    with grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
        stub = pb_grpc.InferenceStub(channel)
        structured = stub.Complete(
            request(response_format_json=json.dumps(RESPONSE_FORMAT)), metadata=metadata, timeout=120
        )
        required = request(tools_json=json.dumps(TOOLS), tool_choice_json='"required"')
        whole = stub.Complete(required, metadata=metadata, timeout=120)
        *_, last = stub.Generate(required, metadata=metadata, timeout=120)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Complete(request(tool_choice_json='"required"'), metadata=metadata, timeout=60)

    assert structured.finish_reason == "stop"
    assert_structured(structured.text)
    assert whole.finish_reason == last.finish_reason == "tool_calls" and whole.text == ""
    calls = [(call.name, call.arguments) for call in whole.tool_calls]
    assert_calls(calls)
    assert [(call.name, call.arguments) for call in last.tool_calls] == calls
    assert (
        refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tool_choice" in refused.value.details()
    )


def test_async_jobs(gateway):
    def finished(client: httpx.Client, body: dict) -> dict:
        response = client.post("/v1/async/chat/completions", headers=auth(), json=body)
        assert response.status_code == 202, response.text
        job_id = response.json()["id"]
        job: dict = {}

        def done() -> bool:
            nonlocal job
            job = client.get(f"/v1/async/jobs/{job_id}", headers=auth()).json()
            return job["status"] in ("succeeded", "failed", "expired", "cancelled")

        wait_until(done, timeout_s=120, what=f"job {job_id}")
        return job

    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        structured = finished(client, STRUCTURED)
        required = finished(client, REQUIRED)
        refused = finished(client, {**STRUCTURED, "tool_choice": "required"})

    assert structured["status"] == "succeeded", structured
    assert_structured(structured["result"]["choices"][0]["message"]["content"])
    assert required["status"] == "succeeded", required
    choice = required["result"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert_calls(
        [
            (call["function"]["name"], call["function"]["arguments"])
            for call in choice["message"]["tool_calls"]
        ]
    )
    # A request the replica refuses fails at once with its 400, not retried.
    assert (refused["status"], refused["status_code"], refused["attempts"]) == ("failed", 400, 1), refused
    assert refused["error"]["param"] == "tool_choice"


def test_batch_lines(gateway):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0)
    lines = [
        {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
        for custom_id, body in (("structured", STRUCTURED), ("required", REQUIRED))
    ]
    uploaded = client.files.create(
        file=("requests.jsonl", io.BytesIO(b"".join(json.dumps(line).encode() + b"\n" for line in lines))),
        purpose="batch",
    )
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )

    def done() -> bool:
        nonlocal batch
        batch = client.batches.retrieve(batch.id)
        return batch.status in ("completed", "expired", "cancelled", "failed")

    wait_until(done, timeout_s=120, what=f"batch {batch.id}")
    assert batch.status == "completed" and batch.request_counts.completed == 2, batch
    output = {
        line["custom_id"]: line["response"]["body"]
        for line in map(json.loads, client.files.content(batch.output_file_id).text.splitlines())
    }
    assert_structured(output["structured"]["choices"][0]["message"]["content"])
    choice = output["required"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert_calls(
        [
            (call["function"]["name"], call["function"]["arguments"])
            for call in choice["message"]["tool_calls"]
        ]
    )


@pytest.mark.parametrize("fields, param", BAD_REQUESTS)
def test_bad_constraints_are_400_naming_the_parameter(gateway, real_replica, fields, param):  # noqa: F811
    """The same 400 from the replica directly and through the gateway."""
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 5, **fields}
    for url, headers in ((real_replica, {}), (gateway.url, auth())):
        response = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["type"]) == (param, "invalid_request_error"), error
