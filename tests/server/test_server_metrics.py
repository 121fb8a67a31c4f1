"""/metrics: parses with prometheus_client, carries vLLM's names under ember: and vllm:, moves with traffic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

MODEL_NAME = "tiny"
PROMPT = (
    "In the beginning the universe was created. This has made a lot of people very angry and been "
    "widely regarded as a bad move."
)

# What llm-d's router / the Gateway API inference extension and vLLM dashboards read.
REQUIRED = [
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "num_preemptions_total",
    "prompt_tokens_total",
    "generation_tokens_total",
    "time_to_first_token_seconds_count",
    "inter_token_latency_seconds_count",
    "request_time_per_output_token_seconds_count",
    "e2e_request_latency_seconds_count",
    "request_queue_time_seconds_count",
    "request_prefill_time_seconds_count",
    "request_decode_time_seconds_count",
]


@pytest.fixture(scope="module")
def client(server, api_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=60)


def test_metrics_parse_and_carry_both_prefixes(server):
    response = httpx.get(f"{server.url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = server.metrics()
    for name in REQUIRED:
        for prefix in ("ember:", "vllm:"):
            assert any(key.startswith(prefix + name + "{") for key in samples), prefix + name
    assert any(key.startswith("vllm:gpu_cache_usage_perc{") for key in samples)
    assert any(key.startswith("vllm:lora_requests_info{") for key in samples)


def test_counters_and_histograms_move_with_traffic(server, auth, client):
    metric = server.metric
    prompt_len = len(
        httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}, headers=auth).json()["tokens"]
    )
    before = server.metrics()
    client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    after = server.metrics()

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    for prefix in ("ember:", "vllm:"):
        assert delta(prefix + "generation_tokens_total") == 7
        assert delta(prefix + "prompt_tokens_total") == prompt_len
        assert delta(prefix + "prefix_cache_queries_total") == prompt_len
        assert delta(prefix + "request_success_total", finished_reason="length") == 1
        assert delta(prefix + "time_to_first_token_seconds_count") == 1
        assert delta(prefix + "e2e_request_latency_seconds_count") == 1
        assert delta(prefix + "request_generation_tokens_sum") == 7
        assert delta(prefix + "request_prompt_tokens_sum") == prompt_len
        assert delta(prefix + "time_to_first_token_seconds_sum") > 0
    assert metric(after, "vllm:num_requests_running") == 0
    assert metric(after, "vllm:num_requests_waiting") == 0

    # A streamed request observes the interval between consecutive tokens: 7 tokens, 6 intervals.
    before = server.metrics()
    list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT + " Again.",
            max_tokens=7,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    after = server.metrics()
    assert delta("vllm:inter_token_latency_seconds_count") == 6
    assert delta("vllm:time_per_output_token_seconds_count") == 6
    assert delta("vllm:request_time_per_output_token_seconds_count") == 1


def test_prefix_cache_hits_show_in_usage_and_metrics(server, client):
    prompt = PROMPT * 3  # several full KV blocks
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    before = server.metrics()
    second = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    after = server.metrics()
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0
    assert cached >= first.usage.prompt_tokens_details.cached_tokens
    hits = server.metric(after, "vllm:prefix_cache_hits_total") - server.metric(
        before, "vllm:prefix_cache_hits_total"
    )
    assert hits == cached


def test_speculative_decoding_serves_plain_outputs_and_counts_drafts(server, client, launch_server, tiny_model_dir):
    """`ember serve --speculative-config` answers what the plain server answers, and /metrics counts the
    drafts (vLLM's spec_decode_* names)."""
    speculative = launch_server(
        tiny_model_dir, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'
    )
    try:
        spec_client = openai.OpenAI(base_url=f"{speculative.url}/v1", api_key="none", max_retries=0, timeout=60)
        prompt = PROMPT + " It was a bad move. It was a bad move. It was"
        request = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 20, "temperature": 0,
                   "extra_body": {"ignore_eos": True}}  # fmt: skip
        expected = client.completions.create(**request)
        got = spec_client.completions.create(**request)
        assert got.choices[0].text == expected.choices[0].text
        assert got.usage.completion_tokens == 20
        streamed = "".join(chunk.choices[0].text for chunk in spec_client.completions.create(**request, stream=True))
        assert streamed == expected.choices[0].text
        samples = speculative.metrics()
        drafts = speculative.metric(samples, "ember:spec_decode_num_draft_tokens_total")
        accepted = speculative.metric(samples, "ember:spec_decode_num_accepted_tokens_total")
        assert drafts > 0 and 0 <= accepted <= drafts
        assert speculative.metric(samples, "vllm:spec_decode_num_drafts_total") > 0
        per_position = [speculative.metric(samples, "ember:spec_decode_num_accepted_tokens_per_pos_total",
                                           position=str(p)) for p in range(3)]  # fmt: skip
        assert sum(per_position) == accepted
        # The plain server has no speculative decoding and says nothing about it.
        assert not any("spec_decode" in name for name in server.metrics())
    finally:
        speculative.stop()


def test_metrics_require_auth_needs_the_api_key(launch_server, tiny_model_dir, api_key):
    protected = launch_server(tiny_model_dir, "--api-key", api_key, "--metrics-require-auth")
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = httpx.get(f"{protected.url}/metrics", headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        response = httpx.get(f"{protected.url}/metrics", headers={"Authorization": f"bearer  {api_key}"})
        assert response.status_code == 200 and "vllm:num_requests_running" in response.text
        assert httpx.get(f"{protected.url}/health").status_code == 200  # probes stay open
    finally:
        protected.stop()


def test_metrics_require_auth_without_an_api_key_is_refused_at_start(tiny_model_dir):
    command = [sys.executable, "-m", "ember.cli", "serve", "--model", str(tiny_model_dir), "--metrics-require-auth"]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ, "EMBER_API_KEY": ""})
    assert finished.returncode != 0
    assert "--metrics-require-auth needs --api-key" in finished.stderr
    assert "Traceback" not in finished.stderr


def test_a_client_leaving_mid_stream_or_mid_request_counts_as_an_abort(server, auth):
    """vLLM's request_success_total{finished_reason="abort"} counts engine requests aborted because the
    client disconnected: once per request, and the request never counts as finished otherwise."""
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "temperature": 0}

    def aborted(samples: dict) -> float:
        return server.metric(samples, "ember:request_success_total", finished_reason="abort")

    def wait_for_aborts(expected: float) -> dict:
        deadline = time.monotonic() + 30
        while True:
            samples = server.metrics()
            if aborted(samples) >= expected or time.monotonic() > deadline:
                return samples
            time.sleep(0.05)

    before = server.metrics()
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, headers=auth,
                      timeout=60) as response:  # fmt: skip
        assert response.status_code == 200
        first_chunk = next(line for line in response.iter_lines() if line.startswith("data: "))
        assert json.loads(first_chunk.removeprefix("data: "))["choices"][0]["finish_reason"] is None
    # Leaving the block closed the connection after the first chunk.
    after_stream = wait_for_aborts(aborted(before) + 1)
    for prefix in ("ember:", "vllm:"):
        name = prefix + "request_success_total"
        assert server.metric(after_stream, name, finished_reason="abort") - server.metric(before, name, finished_reason="abort") == 1
        assert server.metric(after_stream, name, finished_reason="length") == server.metric(before, name, finished_reason="length")

    with pytest.raises(httpx.ReadTimeout):  # gives up waiting for a non-streamed answer, and disconnects
        httpx.post(f"{server.url}/v1/completions", json=body, headers=auth, timeout=0.5)
    after_request = wait_for_aborts(aborted(after_stream) + 1)
    assert aborted(after_request) - aborted(after_stream) == 1
    length = "ember:request_success_total"
    assert server.metric(after_request, length, finished_reason="length") == server.metric(before, length, finished_reason="length")
