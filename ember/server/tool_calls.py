"""OpenAI tool calls for chat completions, Hermes/Qwen style: the tools in the system turn inside <tools>,
calls as <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks, results as <tool_response> user
turns.

tool_choice "auto": the model answers in text or calls; parse_tool_calls reads its <tool_call> blocks.
"required": decoding is constrained to a JSON array of calls (each item one tool's name and arguments under
that tool's schema), as vLLM does; "named": to the named tool's arguments. Either way the arguments parse and
validate. "none": no tools in the prompt, plain text out."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ember.engine.errors import InvalidRequestError
from ember.engine.sampling_params import StructuredOutputSpec
from ember.server.protocol import ChatCompletionRequest, ChatMessage, ToolCall
from ember.server.tool_call_streams import ConstrainedToolCallStream, HermesToolCallStream, accumulate_calls

# The Hermes/Qwen2.5 tool format over ChatML, for models whose own template has no tools branch (SmolLM2).
HERMES_TOOL_TEMPLATE = """\
{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set rest = messages[1:] %}
{%- else %}{%- set system = default_system %}{%- set rest = messages %}{%- endif %}
{{- '<|im_start|>system\\n' + system }}
{%- if tools %}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within ' }}
{{- '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": ' }}
{{- '<args-json-object>}\\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in rest %}
{%- if message.role == 'tool' %}
{%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}
{%- for call in message.tool_calls or [] %}
{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n' + ({'name': call.function.name, 'arguments': call.function.arguments} | tojson)
    + '\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
DEFAULT_SYSTEM = "You are a helpful assistant."  # the system turn a conversation without one gets


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for its prompt, its decoding and its output."""

    choice: str  # "none", "auto", "required" or "named"
    tools: list[dict[str, Any]]  # the request's tools as the template renders them ([] for "none")
    named: str | None  # the function tool_choice names
    spec: StructuredOutputSpec | None  # the grammar decoding follows ("required", "named")
    parallel: bool = True  # parallel_tool_calls: False allows one call at most

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"


def plan_tools(request: ChatCompletionRequest) -> ToolPlan | None:
    """None when the request has no tools; InvalidRequestError naming the field for a tool_choice without
    tools or naming an unknown function."""
    tool_choice = request.tool_choice
    if not request.tools:
        if tool_choice is not None:
            raise InvalidRequestError(
                "tool_choice is only allowed when tools are specified", param="tool_choice"
            )
        return None
    names = [tool.function.name for tool in request.tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools must have distinct function names", param="tools")
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools]
    if tool_choice is None or tool_choice == "auto":
        return ToolPlan("auto", tools, None, None, request.parallel_tool_calls)
    if tool_choice == "none":
        return ToolPlan("none", [], None, None)
    if tool_choice == "required":
        return ToolPlan(
            "required",
            tools,
            None,
            StructuredOutputSpec.json_schema(_calls_schema(request, request.parallel_tool_calls), "tools"),
        )
    name = tool_choice.function.name
    if name not in names:
        raise InvalidRequestError(
            f"tool_choice names function {name!r}, which is not among the tools ({', '.join(names)})",
            param="tool_choice",
        )
    return ToolPlan(
        "named",
        [tools[names.index(name)]],
        name,
        StructuredOutputSpec.json_schema(_parameters(request, name), "tools"),
    )


def tool_schemas(request: ChatCompletionRequest) -> list[StructuredOutputSpec]:
    """Each tool's parameters schema, to compile (an invalid one is a 400 naming `tools`)."""
    return [
        StructuredOutputSpec.json_schema(_parameters(request, tool.function.name), "tools")
        for tool in request.tools or []
    ]


def _parameters(request: ChatCompletionRequest, name: str) -> dict[str, Any]:
    tool = next(tool for tool in request.tools if tool.function.name == name)
    return tool.function.parameters or {"type": "object"}


def _calls_schema(request: ChatCompletionRequest, parallel: bool) -> dict[str, Any]:
    """A JSON array of calls, each {"name": one tool's name, "arguments": under that tool's schema}. Each
    tool's $defs move to the root, where its "#/$defs/..." references point."""
    defs: dict[str, Any] = {}
    items = []
    for tool in request.tools:
        parameters = dict(_parameters(request, tool.function.name))
        defs.update(parameters.pop("$defs", {}))
        items.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as chat templates read them: assistant tool_calls with their arguments as objects."""
    rendered = []
    for message in messages:
        entry: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments_object(call.function.arguments),
                    },
                }
                for call in message.tool_calls
            ]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        rendered.append(entry)
    return rendered


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def tool_call_stream(plan: ToolPlan) -> ConstrainedToolCallStream | HermesToolCallStream:
    """The reader of a choice's calls: the Hermes blocks under "auto", the grammar's shape otherwise."""
    if plan.choice == "auto":
        return HermesToolCallStream(
            (tool["function"]["name"] for tool in plan.tools), max_calls=None if plan.parallel else 1
        )
    return ConstrainedToolCallStream(plan.named)


def parse_tool_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """The message content and the tool calls in a choice's whole text, read as its stream reads them."""
    if plan.choice == "required":
        try:
            json.loads(text)
        except ValueError:  # cut short by max_tokens
            return text, []
    stream = tool_call_stream(plan)
    content, pieces = stream.feed(text)
    rest, more = stream.finish()
    calls = accumulate_calls(pieces + more)
    return ((content + rest) or None, calls) if calls else (text, [])
