"""The proxy path: bodies passed through, SSE event by event, usage accounting, model rewriting."""

from __future__ import annotations

import httpx
import openai
import orjson
from gateway_harness import FakeReplica, gateway_config, http, model_config, wait_until

KEY = {"name": "ci", "secret": "sk-test-ci"}
AUTH = {"authorization": "Bearer sk-test-ci"}


def test_non_streamed_chat_is_passed_through_with_openai_sdk(replicas, start_gateway):
    a, _ = replicas
    gateway = start_gateway(gateway_config({"tiny": model_config(a)}, [dict(KEY)]))
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-test-ci", max_retries=0)
    completion = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0
    )
    assert completion.choices[0].message.content == "Hello from a"
    assert completion.system_fingerprint == "a"
    assert completion.usage.total_tokens == 10
    assert a.requests == [
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0}
    ]
    assert gateway.metric("ember_gateway_requests_total", model="tiny", key="ci", replica="a", status="200") == 1
    usage = http.get(gateway.url + "/v1/usage", headers=AUTH).json()
    assert usage["requests"] == 1 and usage["prompt_tokens"] == 7 and usage["completion_tokens"] == 3


def test_stream_passes_events_through_before_the_replica_finishes(replicas, start_gateway):
    a, _ = replicas
    a.pause_after_first_chunk = True
    gateway = start_gateway(gateway_config({"tiny": model_config(a)}, [dict(KEY)]))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = response.iter_lines()
        first = next(line for line in lines if line)
        # The replica is still parked after its first chunk: the gateway did not buffer.
        assert orjson.loads(first.removeprefix("data: "))["choices"][0]["delta"]["content"] == "Hello"
        assert a.in_flight == 1
        a.release()
        rest = [line for line in lines if line]
    contents = [orjson.loads(line.removeprefix("data: "))["choices"][0]["delta"]["content"] for line in rest[:-1]]
    assert contents == [" from", " a"]
    assert rest[-1] == "data: [DONE]"
    # The gateway asked for usage (to account tokens) and removed the usage-only chunk the client did not ask for.
    assert a.requests[0]["stream_options"] == {"include_usage": True}
    wait_until(lambda: gateway.dispatcher.usage.snapshot("inline:ci")["total_tokens"] == 10, what="usage")


def test_stream_with_usage_requested_keeps_the_usage_chunk(replicas, start_gateway):
    a, _ = replicas
    gateway = start_gateway(gateway_config({"tiny": model_config(a)}, [dict(KEY)]))
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-test-ci", max_retries=0)
    stream = client.completions.create(
        model="tiny", prompt="once", stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == "Hello from a"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 10


def test_deployment_model_id_is_sent_upstream(start_gateway):
    replica = FakeReplica("v2").start()
    try:
        models = {
            "tiny": {"deployments": [{"name": "v2", "model": "tiny-v2", "replicas": [{"url": replica.url}]}]}
        }
        gateway = start_gateway(gateway_config(models, [dict(KEY)]))
        response = http.post(
            gateway.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=AUTH, timeout=30
        )
        assert response.status_code == 200
        assert replica.requests[0]["model"] == "tiny-v2"
        assert response.headers["x-ember-replica"] == replica.url
    finally:
        replica.stop()


def test_bad_requests_get_openai_errors(replicas, start_gateway):
    a, _ = replicas
    gateway = start_gateway(gateway_config({"tiny": model_config(a)}, [dict(KEY)]))
    url = gateway.url + "/v1/chat/completions"
    cases = [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (orjson.dumps({"messages": []}), 400, "model"),
        (orjson.dumps({"model": "nope", "messages": []}), 404, "model"),
    ]
    for content, status, param in cases:
        response = http.post(url, content=content, headers=AUTH)
        assert response.status_code == status, content
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    bad_header = http.post(url, json={"model": "tiny"}, headers={**AUTH, "x-ember-deadline-ms": "soon"})
    assert bad_header.status_code == 400 and "x-ember-deadline-ms" in bad_header.json()["error"]["message"]
    unknown = http.get(gateway.url + "/v1/nothing", headers=AUTH)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "unknown_url"
    assert a.requests == []


def test_models_health_ready_metrics(replicas, start_gateway):
    a, b = replicas
    gateway = start_gateway(
        gateway_config(
            {"tiny": model_config(a), "other": model_config(b)},
            [dict(KEY), {"name": "narrow", "secret": "sk-narrow", "models": ["other"]}],
        )
    )
    all_models = http.get(gateway.url + "/v1/models", headers=AUTH).json()
    assert [model["id"] for model in all_models["data"]] == ["tiny", "other"]
    narrow = http.get(gateway.url + "/v1/models", headers={"authorization": "Bearer sk-narrow"}).json()
    assert [model["id"] for model in narrow["data"]] == ["other"]
    assert http.get(gateway.url + "/health").json() == {"status": "ok"}
    ready = http.get(gateway.url + "/ready")
    assert ready.status_code == 200 and ready.json()["healthy_replicas"] == {"tiny": 1, "other": 1}
    text = http.get(gateway.url + "/metrics").text
    assert 'ember_gateway_replica_healthy{deployment="main",model="tiny",region="",replica="a"} 1.0' in text


def test_a_client_leaving_mid_stream_aborts_the_replica_request(replicas, start_gateway):
    a, _ = replicas
    a.pause_after_first_chunk = True
    gateway = start_gateway(gateway_config({"tiny": model_config(a)}, [dict(KEY)]))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=30) as response:
        assert next(line for line in response.iter_lines() if line).startswith("data: ")
    # The client hung up while the replica was parked mid-stream: the gateway closes its upstream request.
    wait_until(lambda: a.aborted == 1, what="the replica to see the abort")
    replica = gateway.dispatcher.pool.get("a")
    wait_until(lambda: replica.outstanding == 0, what="the slot to be released")
    assert gateway.metric("ember_gateway_requests_total", model="tiny", key="ci", replica="a", status="stream_cancelled") == 1
    a.release()


INTERNAL_ERROR = {
    "error": {
        "message": "Internal server error; see the gateway log",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }
}


def test_an_unexpected_exception_is_an_openai_500_with_its_traceback_in_the_log(replicas, start_gateway, caplog):
    a, _ = replicas
    gateway = start_gateway(gateway_config({"tiny": model_config(a)}, [dict(KEY)]))
    raised: list[str] = []

    def buggy_listener(event: str, replica) -> None:  # a bug on the proxy path, once
        if event == "release" and not raised:
            raised.append(event)
            raise RuntimeError("a bug in a pool listener")

    async def buggy_route() -> None:  # a bug on the FastAPI side
        raise RuntimeError("a bug in a route")

    gateway.server.call(lambda: gateway.dispatcher.pool.add_listener(buggy_listener))
    gateway.app.api.add_api_route("/buggy", buggy_route)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    proxied = http.post(gateway.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=30)
    routed = http.get(gateway.url + "/buggy", timeout=30)
    for response in (proxied, routed):
        assert response.status_code == 500
        assert response.headers["content-type"] == "application/json"
        assert response.json() == INTERNAL_ERROR
    assert routed.headers["connection"] == "close"  # uvicorn closes it: the exception is raised again
    logged = [record for record in caplog.records if record.message.startswith("unhandled error on")]
    assert [record.message for record in logged] == [
        "unhandled error on POST /v1/chat/completions",
        "unhandled error on GET /buggy",
    ]
    assert [str(record.exc_info[1]) for record in logged] == ["a bug in a pool listener", "a bug in a route"]
    # The gateway still serves.
    assert http.post(gateway.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=30).status_code == 200
