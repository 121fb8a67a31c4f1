"""Which chat template renders tools: SmolLM2's ChatML template has no tools branch, so its prompts get the
Hermes tool format; a model whose own template renders tools keeps it. Checked on the prompt itself, through
/tokenize with `tools` (which renders exactly what a chat request with those tools is given) and /detokenize
(which leaves out the special tokens: <|im_start|> and <|im_end|>)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ServerProcess
from tests.structured.conftest import MODEL_NAME

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CONVERSATION = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 3}'},
]
# A ChatML template with its own tools branch, as Qwen2.5's has (shortened).
OWN_TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nOWN-TOOLS ' + (tools | map(attribute='function.name') | join(','))"
    " + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def prompt_text(server: ServerProcess, messages: list[dict], tools: list[dict] | None) -> str:
    response = httpx.post(
        f"{server.url}/tokenize", json={"model": MODEL_NAME, "messages": messages, "tools": tools}, timeout=60
    )
    assert response.status_code == 200, response.text
    detokenized = httpx.post(
        f"{server.url}/detokenize",
        json={"model": MODEL_NAME, "tokens": response.json()["tokens"]},
        timeout=60,
    )
    return detokenized.json()["prompt"]


def test_smollm2_gets_the_hermes_tool_format(smollm2_server):
    text = prompt_text(smollm2_server, CONVERSATION, [WEATHER])
    assert text.startswith("system\nYou are a helpful assistant.\n\n# Tools\n")
    assert f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in text
    assert (
        '\nassistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        in text
    )
    assert text.endswith('\nuser\n<tool_response>\n{"temperature": 3}\n</tool_response>\nassistant\n')
    # The prompt a chat request with these tools is given: the same token count.
    completion = httpx.post(
        f"{smollm2_server.url}/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": CONVERSATION, "tools": [WEATHER], "max_tokens": 1},
        timeout=120,
    )
    assert completion.status_code == 200, completion.text
    tokens = httpx.post(
        f"{smollm2_server.url}/tokenize",
        json={"model": MODEL_NAME, "messages": CONVERSATION, "tools": [WEATHER]},
        timeout=60,
    ).json()
    assert completion.json()["usage"]["prompt_tokens"] == tokens["count"]
    # Without tools or tool turns, SmolLM2's own template.
    plain = prompt_text(smollm2_server, CONVERSATION[:1], None)
    assert "<tools>" not in plain and plain.endswith("\nuser\nWeather in Oslo?\nassistant\n")


@pytest.fixture
def own_template_server(tiny_model_dir: Path, tmp_path: Path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").write_text(OWN_TOOLS_TEMPLATE)
    server = ServerProcess(model, tmp_path / "serve.log")
    yield server
    server.stop()


def test_a_template_with_a_tools_branch_renders_the_tools_itself(own_template_server):
    text = prompt_text(own_template_server, CONVERSATION[:1], [WEATHER])
    assert text == "system\nOWN-TOOLS get_weather\nuser\nWeather in Oslo?\nassistant\n"
