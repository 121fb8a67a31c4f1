"""The OpenAI-compatible endpoints through the official `openai` SDK and httpx, against `ember serve`."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

MODEL_NAME = "tiny"  # --served-model-name of the `server` fixture
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(server, api_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=60)


def tokenize(server, auth, **body) -> list[int]:
    response = httpx.post(f"{server.url}/tokenize", json={"model": MODEL_NAME, **body}, headers=auth)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_completion_non_streamed_usage_matches_tokens(server, auth, client):
    result = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert result.object == "text_completion"
    assert result.id.startswith("cmpl-")
    assert result.model == MODEL_NAME
    assert result.system_fingerprint
    choice = result.choices[0]
    assert choice.finish_reason == "length"
    assert result.usage.prompt_tokens == len(tokenize(server, auth, prompt=PROMPT))
    assert result.usage.completion_tokens == 12
    assert result.usage.total_tokens == result.usage.prompt_tokens + 12
    assert result.usage.prompt_tokens_details.cached_tokens >= 0
    # The text is exactly the 12 generated tokens: re-tokenizing prompt + text gives them back.
    assert len(tokenize(server, auth, prompt=PROMPT + choice.text)) >= result.usage.prompt_tokens


def test_streamed_completion_equals_non_streamed_for_greedy(client):
    kwargs = dict(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text_chunks = [chunk for chunk in chunks if chunk.choices]
    assert "".join(chunk.choices[0].text for chunk in text_chunks) == full.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(chunk.choices[0].finish_reason is None for chunk in text_chunks[:-1])
    assert len({chunk.id for chunk in chunks}) == 1
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens) == (full.usage.prompt_tokens, 24)


def test_one_sse_event_per_generated_token(server, auth):
    body = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=auth, timeout=60
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(event.startswith("data: {") for event in events[:-1])
    # 16 tokens, one event each (unless a token's text is empty, which this prompt does not produce).
    assert len(events) - 1 == 16


def test_chat_non_streamed_and_streamed_agree(server, auth, client):
    kwargs = dict(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    full = client.chat.completions.create(**kwargs)
    assert full.object == "chat.completion"
    assert full.id.startswith("chatcmpl-")
    message = full.choices[0].message
    assert message.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    prompt_ids = tokenize(server, auth, messages=MESSAGES)
    assert full.usage.prompt_tokens == len(prompt_ids)
    assert full.usage.completion_tokens == 20

    stream = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    assert stream[0].choices[0].delta.role == "assistant"
    content = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert content == message.content
    finishes = [chunk.choices[0].finish_reason for chunk in stream if chunk.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert stream[-1].usage.completion_tokens == 20
    assert stream[-1].usage.prompt_tokens == len(prompt_ids)


def test_n_three_choices(client):
    result = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=8,
        temperature=1.0,
        seed=7,
        n=3,
        extra_body={"ignore_eos": True},
    )
    assert sorted(choice.index for choice in result.choices) == [0, 1, 2]
    assert result.usage.completion_tokens == 24
    assert len({choice.text for choice in result.choices}) > 1  # seeded siblings draw differently

    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=6, n=3, seed=3, extra_body={"ignore_eos": True}
    )
    assert sorted(choice.index for choice in chat.choices) == [0, 1, 2]
    assert chat.usage.completion_tokens == 18

    streamed = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=5,
            n=3,
            seed=7,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    finished = sorted(chunk.choices[0].index for chunk in streamed if chunk.choices[0].finish_reason)
    assert finished == [0, 1, 2]


def test_stop_string_ends_the_text(client):
    kwargs = dict(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=30, temperature=0, extra_body={"ignore_eos": True}
    )
    text = client.completions.create(**kwargs).choices[0].text
    words = text.split()
    assert len(words) >= 4, text
    stop = words[3]
    expected = text[: text.index(stop)]
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(stop=[stop], stream=True, **kwargs))
            got = "".join(chunk.choices[0].text for chunk in chunks)
            choice = chunks[-1].choices[0]
        else:
            choice = client.completions.create(stop=[stop], **kwargs).choices[0]
            got = choice.text
        assert got == expected
        assert choice.finish_reason == "stop"
        assert choice.model_extra["stop_reason"] == stop


def test_completion_logprobs(client):
    result = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    choice = result.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset[0] == 0
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert logprob <= 0
        assert len(top) == 3  # greedy: the sampled token is the top-1, so it is among the 3
        assert top[token] == pytest.approx(logprob)
        assert max(top.values()) == pytest.approx(logprob)


def test_chat_logprobs_streamed_and_not(client):
    kwargs = dict(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**kwargs)
    content = full.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(entry.token for entry in content) == full.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.bytes == list(entry.token.encode())
    streamed = [
        entry
        for chunk in client.chat.completions.create(stream=True, **kwargs)
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [entry.token for entry in streamed] == [entry.token for entry in content]


def test_batch_and_token_id_prompts(server, auth, client):
    prompt_ids = tokenize(server, auth, prompt=PROMPT)
    by_text = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(
        model=MODEL_NAME, prompt=[PROMPT, "Hello"], max_tokens=5, temperature=0, n=2
    )
    assert sorted(choice.index for choice in batch.choices) == [0, 1, 2, 3]
    assert [c.text for c in batch.choices if c.index < 2] == [by_text.choices[0].text] * 2
    hello_len = len(tokenize(server, auth, prompt="Hello"))
    assert batch.usage.prompt_tokens == len(prompt_ids) + hello_len


def test_echo_prepends_the_prompt(client):
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0)
    echoed = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, echo=True
    )
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    streamed = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in streamed) == PROMPT + plain.choices[0].text


def test_models_tokenize_detokenize_version_health(server, auth, client):
    models = client.models.list()
    assert [model.id for model in models.data] == [MODEL_NAME]
    assert models.data[0].model_extra["max_model_len"] == 1024
    tokens = tokenize(server, auth, prompt=PROMPT)
    response = httpx.post(
        f"{server.url}/detokenize", json={"model": MODEL_NAME, "tokens": tokens}, headers=auth
    )
    assert response.status_code == 200
    assert response.json() == {"prompt": PROMPT}
    assert httpx.get(f"{server.url}/version").json()["version"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/ready").status_code == 200


def test_access_log_has_one_line_per_request(server, auth):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True}
    response = httpx.post(
        f"{server.url}/v1/completions", json=body, headers={**auth, "X-Request-Id": "trace-42"}
    )
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "trace-42"
    completion_id = response.json()["id"]
    # The line is written once the response has been sent, so it may land just after the client has it.
    deadline = time.monotonic() + 30
    while completion_id not in server.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = [line for line in server.log().splitlines() if completion_id in line]
    assert len(lines) == 1
    line = lines[0]
    for field in (
        '"request_id":"trace-42"',
        '"status":200',
        '"completion_tokens":3',
        '"ttft_s":',
        '"total_s":',
    ):
        assert field in line, line


def test_echo_with_logprobs_scores_the_prompt(server, auth, client):
    """OpenAI's legacy scoring request (lm-eval's loglikelihood): the prompt's tokens with their logprobs,
    the first without one, then the generated tokens'."""
    prompt_ids = tokenize(server, auth, prompt=PROMPT)
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    scored = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True
    )
    choice = scored.choices[0]
    assert choice.text == PROMPT + plain.choices[0].text
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(prompt_ids) + 3
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs[1:])  # top 2, plus the token itself
    assert "".join(logprobs.tokens[: len(prompt_ids)]) == PROMPT
    assert logprobs.text_offset[len(prompt_ids)] == len(PROMPT)
    # The generated part is what the request without echo returned.
    assert logprobs.tokens[len(prompt_ids):] == plain.choices[0].logprobs.tokens
    assert logprobs.token_logprobs[len(prompt_ids):] == pytest.approx(plain.choices[0].logprobs.token_logprobs,
                                                                         abs=1e-4)
    # Scoring the same text again gives the same prompt logprobs (no prefix-cache shortcut).
    again = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True
    )
    assert again.choices[0].logprobs.token_logprobs[1:] == pytest.approx(logprobs.token_logprobs[1:], abs=1e-5)
    # Streamed: the first chunk echoes the prompt with its scores, then the generated tokens follow.
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True, stream=True
    ))  # fmt: skip
    assert "".join(chunk.choices[0].text for chunk in chunks) == choice.text
    streamed = [lp for chunk in chunks for lp in chunk.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None
    assert streamed[1:] == pytest.approx(logprobs.token_logprobs[1:], abs=1e-5)
    assert [offset for chunk in chunks for offset in chunk.choices[0].logprobs.text_offset] == logprobs.text_offset


def test_prompt_logprobs_as_vllm(server, auth, client):
    """vLLM's prompt_logprobs extra: per prompt token {token id: {logprob, rank, decoded_token}}, the first
    None; on the completion choice for /v1/completions, at the top level for chat; not with streaming."""
    prompt_ids = tokenize(server, auth, prompt=PROMPT)
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    completion = httpx.post(f"{server.url}/v1/completions", json=body, headers=auth).json()
    entries = completion["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(prompt_ids) and entries[0] is None
    echoed = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=2, echo=True
    )
    for position, (token_id, entry) in enumerate(zip(prompt_ids[1:], entries[1:], strict=True), start=1):
        assert 1 <= len(entry) <= 3  # the token plus the top 2
        assert entry[str(token_id)]["logprob"] == pytest.approx(
            echoed.choices[0].logprobs.token_logprobs[position], abs=1e-5
        )
        assert sorted(item["rank"] for key, item in entry.items() if item["rank"] <= 2) == [1, 2]
    plain = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt_logprobs": None}, headers=auth)
    assert plain.json()["choices"][0]["prompt_logprobs"] is None

    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "prompt_logprobs": 0}  # fmt: skip
    response = httpx.post(f"{server.url}/v1/chat/completions", json=chat, headers=auth).json()
    rendered = response["usage"]["prompt_tokens"]
    assert len(response["prompt_logprobs"]) == rendered and response["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in response["prompt_logprobs"][1:])  # just the token itself

    streamed = httpx.post(f"{server.url}/v1/chat/completions", json={**chat, "stream": True}, headers=auth)
    assert streamed.status_code == 400, streamed.text
    assert "prompt_logprobs" in streamed.json()["error"]["message"]
