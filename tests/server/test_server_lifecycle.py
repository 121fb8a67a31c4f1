"""Load and lifecycle: cancellation frees KV blocks, bounded admission (429/408), SIGTERM/SIGINT drain,
/health answering under many streams."""

from __future__ import annotations

import asyncio
import json
import signal
import threading

import httpx
import pytest

MODEL_NAME = "tiny"
PROMPT = "Tell me a very long story about a lighthouse keeper and the sea."
# Holds the only sequence slot well past the 8 s queue timeout even at the tiny model's fastest (~1 ms/token).
LONG_REQUEST_TOKENS = 16000


def completion(max_tokens: int, stream: bool) -> dict:
    return {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


def data_events(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: ") :]


def test_cancel_mid_stream_frees_blocks(server, auth):
    idle = server.metrics()
    idle_kv = server.metric(idle, "vllm:kv_cache_usage_perc")
    generated_before = server.metric(idle, "vllm:generation_tokens_total")
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=completion(900, True), headers=auth, timeout=60
    ) as response:
        assert response.status_code == 200
        events = data_events(response)
        for _ in range(3):
            next(events)
        busy = server.metrics()
        assert server.metric(busy, "ember:num_requests_running") == 1
        assert server.metric(busy, "vllm:kv_cache_usage_perc") > idle_kv
    # The client closed the stream: the engine aborts the request and frees its blocks.
    after = server.wait_for_metric("ember:num_requests_running", 0)
    assert server.metric(after, "ember:num_requests_running") == 0
    assert server.metric(after, "vllm:num_requests_waiting") == 0
    assert server.metric(after, "vllm:kv_cache_usage_perc") == idle_kv
    assert server.metric(after, "vllm:generation_tokens_total") - generated_before < 900


def test_health_answers_while_many_streams_run(server, auth):
    async def run() -> tuple[list[int], list[int], bool]:
        async with httpx.AsyncClient(base_url=server.url, headers=auth, timeout=120) as client:

            async def one_stream() -> int:
                tokens = 0
                async with client.stream("POST", "/v1/completions", json=completion(64, True)) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            tokens += 1
                return tokens

            streams = [asyncio.create_task(one_stream()) for _ in range(32)]
            while not any(task.done() for task in streams):
                running = server.metric(await _metrics(client), "ember:num_requests_running")
                if running >= 8:
                    break
                await asyncio.sleep(0.02)
            statuses = [(await client.get("/health")).status_code for _ in range(5)]
            answered_during_load = not all(task.done() for task in streams)
            return statuses, await asyncio.gather(*streams), answered_during_load

    statuses, tokens, answered_during_load = asyncio.run(run())
    assert statuses == [200] * 5
    assert answered_during_load
    assert tokens == [64] * 32


async def _metrics(client: httpx.AsyncClient) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = (await client.get("/metrics")).text
    return {
        f"{s.name}{{{','.join(f'{k}={json.dumps(v)}' for k, v in sorted(s.labels.items()))}}}": s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture(scope="module")
def limited_server(launch_server, long_context_model_dir):
    """One sequence at a time, one queued request, 8 s queue timeout; the drain test ends it."""
    process = launch_server(
        long_context_model_dir,
        "--max-model-len",
        str(LONG_REQUEST_TOKENS + 64),
        "--max-num-seqs",
        "1",
        "--max-queued-requests",
        "1",
        "--queue-timeout",
        "8",
        "--drain-timeout",
        "120",
    )
    yield process
    process.stop()


def test_client_giving_up_on_a_non_streamed_request_aborts_it(limited_server):
    # 16000 tokens take seconds at any speed; the shared server's 1000 once finished inside the 1 s timeout.
    server = limited_server
    generated_before = server.metric(server.metrics(), "vllm:generation_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=completion(LONG_REQUEST_TOKENS, False), timeout=1.0)
    after = server.wait_for_metric("ember:num_requests_running", 0)
    assert server.metric(after, "ember:num_requests_running") == 0
    assert server.metric(after, "vllm:generation_tokens_total") - generated_before < LONG_REQUEST_TOKENS


@pytest.mark.slow
def test_full_queue_gets_429_and_queue_timeout_408(limited_server):
    server = limited_server
    url = f"{server.url}/v1/completions"
    with httpx.stream("POST", url, json=completion(LONG_REQUEST_TOKENS, True), timeout=120) as running:
        running_events = data_events(running)  # keep the generator: dropping it closes the stream
        next(running_events)  # A holds the only sequence slot
        waited: dict = {}

        def queued_request() -> None:
            waited["response"] = httpx.post(url, json=completion(4, False), timeout=60)

        thread = threading.Thread(target=queued_request)
        thread.start()
        server.wait_for_metric("vllm:num_requests_waiting", 1)  # B waits in the engine's queue
        rejected = httpx.post(url, json=completion(4, False), timeout=30)
        assert rejected.status_code == 429
        assert rejected.headers["retry-after"] == "1"
        assert rejected.json()["error"]["code"] == "queue_full"
        assert rejected.json()["error"]["type"] == "rate_limit_error"
        thread.join(timeout=60)
        timed_out = waited["response"]
        assert timed_out.status_code == 408
        assert timed_out.json()["error"]["code"] == "queue_timeout"
        samples = server.wait_for_metric("vllm:num_requests_waiting", 0)
        assert server.metric(samples, "vllm:num_requests_waiting") == 0
        assert server.metric(samples, "ember:request_rejected_total", reason="queue_full") == 1
        assert server.metric(samples, "ember:request_rejected_total", reason="queue_timeout") == 1


@pytest.mark.slow
def test_sigterm_drains_the_in_flight_stream_then_exits_0(limited_server):
    server = limited_server
    max_tokens = 1000
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=completion(max_tokens, True), timeout=120
    ) as response:
        events = data_events(response)
        chunks = [json.loads(next(events))]
        server.signal(signal.SIGTERM)
        # Draining: not ready, new requests refused with 503, the listener still answers.
        ready = httpx.get(f"{server.url}/ready", timeout=30)
        assert ready.status_code == 503
        assert ready.json()["error"]["code"] == "server_draining"
        refused = httpx.post(f"{server.url}/v1/completions", json=completion(2, False), timeout=30)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "server_draining"
        rest = list(events)
    assert rest[-1] == "[DONE]"
    chunks += [json.loads(event) for event in rest[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(timeout=60) == 0
    assert f'"completion_tokens":{max_tokens}' in server.log()
