"""OpenAI tool calls over HTTP with the official openai SDK and the real SmolLM2: tool_choice "required" and
named calls whose arguments validate, an agent loop, streamed calls equal to whole ones, and the 400s."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from ember.server.protocol import ChatCompletionRequest
from ember.server.tool_calls import parse_tool_calls, plan_tools
from tests.structured.conftest import MODEL_NAME

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
        "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
    },
    "required": ["a", "b"],
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "maxLength": 30},
        "limit": {"type": "integer", "minimum": 1, "maximum": 10},
    },
    "required": ["query"],
}
SCHEMAS = {"get_weather": WEATHER, "add": ADD, "search": SEARCH}
TOOLS = [
    {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}
    for (name, schema), description in zip(
        SCHEMAS.items(), ("Current weather in a city", "Add two integers", "Search the web"), strict=True
    )
]
QUESTIONS = [
    "What is the weather in Paris?",
    "What is 12 plus 30?",
    "Find recipes for pancakes.",
    "Is it raining in Tokyo?",
    "Add 7 and 8.",
    "Search for the tallest building.",
    "How warm is it in Cairo in fahrenheit?",
    "What is -5 plus 100?",
    "Look up the news.",
    "Weather in Berlin and the sum of 2 and 2?",
]


def _client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _assert_valid(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_calls_validate_fifty_of_fifty(smollm2_server):
    """10 questions x n=5 sampled choices under tool_choice "required" (one call each): every choice calls, every call's
    arguments validate against the chosen tool's schema."""

    async def one(client, question):
        return await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": question}],
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            n=5,
            temperature=0.8,
            seed=11,
            max_tokens=100,
        )

    async def run():
        async with _client(smollm2_server) as client:
            return await asyncio.gather(*(one(client, question) for question in QUESTIONS))

    choices = [choice for completion in asyncio.run(run()) for choice in completion.choices]
    assert len(choices) == 50
    for choice in choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and choice.message.tool_calls
        for call in choice.message.tool_calls:
            _assert_valid(call)


def test_named_tool_choice_calls_that_tool(smollm2_server):
    async def run():
        async with _client(smollm2_server) as client:
            return await client.chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": "What is 3 plus 4?"}],
                tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "add"}},
                temperature=0,
                max_tokens=60,
            )

    choice = asyncio.run(run()).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "add"
    _assert_valid(call)


def test_agent_loop_calls_a_tool_then_answers(smollm2_server):
    """The model calls get_weather, the test runs it and sends the tool message back, the model answers."""

    async def run():
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        async with _client(smollm2_server) as client:
            first = await client.chat.completions.create(
                model=MODEL_NAME,
                messages=messages,
                tools=TOOLS[:1],
                tool_choice="required",
                parallel_tool_calls=False,
                temperature=0,
                max_tokens=60,
            )
            (call,) = first.choices[0].message.tool_calls
            arguments = json.loads(call.function.arguments)
            messages.append(first.choices[0].message.model_dump(exclude_none=True))
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call.id,
                    "content": json.dumps({"city": arguments["city"], "temperature": 21}),
                }
            )
            second = await client.chat.completions.create(
                model=MODEL_NAME,
                messages=messages,
                tools=TOOLS[:1],
                tool_choice="none",
                temperature=0,
                max_tokens=40,
            )
            return call, second.choices[0]

    call, answer = asyncio.run(run())
    assert call.function.name == "get_weather"
    _assert_valid(call)
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "search"}}])
def test_streamed_tool_calls_accumulate_to_the_whole_ones(smollm2_server, tool_choice):
    request = dict(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Weather in Rome, and add 1 and 2."}],
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=120,
    )

    async def run():
        async with _client(smollm2_server) as client:
            whole = await client.chat.completions.create(**request)
            return whole.choices[0], *await _stream_with_the_sdk(client, request)

    whole, streamed, kinds = asyncio.run(run())
    # The arguments arrive as they are generated: in many chunks, not one.
    assert kinds == [(0, "name")] + [(0, "arguments")] * (len(kinds) - 1) and len(kinds) > 4
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"
    assert [(call.function.name, call.function.arguments) for call in streamed.message.tool_calls] == [
        (call.function.name, call.function.arguments) for call in whole.message.tool_calls
    ]
    assert all(call.id.startswith("call_") for call in streamed.message.tool_calls)


async def _stream_with_the_sdk(client: openai.AsyncOpenAI, request: dict) -> tuple[object, list]:
    """The choice the openai SDK's stream helper accumulates, and what each streamed chunk carried, in order:
    "content", or (call index, "name" | "arguments") per tool-call piece."""
    kinds: list = []
    async with client.chat.completions.stream(**request) as stream:
        async for event in stream:
            if event.type != "chunk" or not event.chunk.choices:
                continue
            delta = event.chunk.choices[0].delta
            kinds += ["content"] if delta.content else []
            kinds += [(piece.index, "name" if piece.id else "arguments") for piece in delta.tool_calls or []]
        final = await stream.get_final_completion()
    return final.choices[0], kinds


# SmolLM2-135M does not call tools by itself under "auto": this regex steers it into prose followed by two
# Hermes blocks, so the "auto" reader sees real tokens of a call (the city and the numbers are the model's).
AUTO_CALLS_REGEX = (
    r'[A-Z][a-z ,]{2,40}\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,12}", '
    r'"unit": "(celsius|fahrenheit)"\}\}\n</tool_call>\n<tool_call>\n\{"name": "add", "arguments": '
    r'\{"a": [1-9][0-9]?, "b": [1-9][0-9]?\}\}\n</tool_call>'
)


@pytest.mark.parametrize("steer", ["calls", "text"])
def test_auto_streams_content_then_calls_as_the_sdk_accumulates_them(smollm2_server, steer):
    """tool_choice "auto": content streams as it is generated until a <tool_call> block starts, then each call
    streams (id and name first, then argument fragments); the openai SDK's stream helper accumulates exactly
    the non-streamed message, logprobs included. Unsteered, the model answers in text, which streams as
    content."""
    request = dict(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "What is the weather in Paris, and what is 2 plus 3?"}],
        tools=TOOLS,
        tool_choice="auto",
        temperature=0,
        max_tokens=120,
        logprobs=True,
        extra_body={"guided_regex": AUTO_CALLS_REGEX} if steer == "calls" else None,
    )

    async def run():
        async with _client(smollm2_server) as client:
            whole = await client.chat.completions.create(**request)
            return whole.choices[0], *await _stream_with_the_sdk(client, request)

    whole, streamed, kinds = asyncio.run(run())
    assert streamed.finish_reason == whole.finish_reason
    # Every token's logprob, tool-call tokens included, in the stream as in the whole response (the values to
    # rounding).
    assert [entry.token for entry in streamed.logprobs.content] == [
        entry.token for entry in whole.logprobs.content
    ]
    assert [entry.logprob for entry in streamed.logprobs.content] == pytest.approx(
        [entry.logprob for entry in whole.logprobs.content], abs=0.05
    )
    assert len(whole.logprobs.content) > 10
    assert streamed.message.content == whole.message.content and whole.message.content
    calls = [(call.function.name, call.function.arguments) for call in whole.message.tool_calls or []]
    assert [
        (call.function.name, call.function.arguments) for call in streamed.message.tool_calls or []
    ] == calls
    if steer == "text":
        assert calls == [] and kinds.count("content") > 3
        return
    assert whole.finish_reason == "tool_calls" and [name for name, _ in calls] == ["get_weather", "add"]
    for call in whole.message.tool_calls:
        _assert_valid(call)
    # The content came first, in several chunks; then per call its name, then its arguments in fragments.
    first_call = kinds.index((0, "name"))
    assert kinds[:first_call] == ["content"] * first_call and first_call > 3
    assert kinds[first_call:] == [(0, "name")] + [(0, "arguments")] * kinds.count((0, "arguments")) + [
        (1, "name")
    ] + [(1, "arguments")] * kinds.count((1, "arguments"))
    assert kinds.count((0, "arguments")) > 3 and kinds.count((1, "arguments")) > 3


def test_auto_parses_hermes_blocks_and_keeps_plain_answers():
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    )
    plan = plan_tools(request)
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    )
    content, calls = parse_tool_calls(plan, text)
    assert content == "Let me check."
    assert [(call.function.name, json.loads(call.function.arguments)) for call in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"}),
        ("add", {"a": 1, "b": 2}),
    ]
    assert parse_tool_calls(plan, "Hello there!") == ("Hello there!", [])
    # An unknown function or broken JSON is not a call: the text stays content.
    assert parse_tool_calls(plan, '<tool_call>{"name": "rm", "arguments": {}}</tool_call>')[1] == []


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
            "tools",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ],
)
def test_tool_errors_are_400_naming_the_field(smollm2_server, fields, param):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **fields}
    response = httpx.post(f"{smollm2_server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
