"""Replicas that join and leave a running gateway (what `ember up`'s autoscaler does), and a model
with no replica holding requests until one joins (scale from zero), over real HTTP."""

from __future__ import annotations

import concurrent.futures

import pytest
from gateway_harness import FakeReplica, gateway_config, http, wait_until

from ember.gateway.admin import CONTROL_TOKEN_ENV

KEY = "sk-test"
TOKEN = "control-token-for-tests"
CONTROL = {"authorization": f"Bearer {TOKEN}"}
AUTH = {"authorization": f"Bearer {KEY}"}


def autoscaled_config(hold_limit: int = 4, **extra) -> dict:
    model = {
        "deployments": [{"name": "main", "model": "tiny-v1", "replicas": []}],
        "autoscaling": {"min_replicas": 0, "max_replicas": 2, "ttft_p90_ms": 1000, "itl_p90_ms": 100,
                        "hold_limit": hold_limit},
    }  # fmt: skip
    return gateway_config({"tiny": model}, [{"name": "k", "secret": KEY}], **extra)


@pytest.fixture
def gateway(start_gateway, monkeypatch):
    monkeypatch.setenv(CONTROL_TOKEN_ENV, TOKEN)
    return start_gateway(autoscaled_config(queue={"max_size": 100, "default_deadline_ms": 20_000}))


@pytest.fixture
def fake():
    replica = FakeReplica("r1").start()
    yield replica
    replica.stop()


def chat(gateway_url: str, stream: bool = False):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    return http.post(gateway_url + "/v1/chat/completions", json=body, headers=AUTH)


def register(gateway_url: str, replica: FakeReplica, **fields):
    body = {"model": "tiny", "url": replica.url, "id": replica.name, "capacity": 2, **fields}
    return http.post(gateway_url + "/admin/replicas", json=body, headers=CONTROL)


def test_registration_needs_the_control_token_or_the_admin_key(gateway, fake):
    response = http.post(gateway.url + "/admin/replicas", json={"model": "tiny", "url": fake.url}, headers=AUTH)
    assert response.status_code == 403 and response.json()["error"]["code"] == "endpoint_not_allowed"
    response = http.post(
        gateway.url + "/admin/replicas", json={"model": "tiny", "url": fake.url}, headers={"authorization": "Bearer x"}
    )
    assert response.status_code == 403


def test_a_request_for_a_model_without_replicas_is_held_then_served_by_the_replica_that_joins(gateway, fake):
    ready = http.get(gateway.url + "/ready")
    assert ready.status_code == 200 and ready.json()["healthy_replicas"] == {"tiny": 0}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        plain = pool.submit(chat, gateway.url)
        streamed = pool.submit(chat, gateway.url, True)
        wait_until(lambda: gateway.metric("ember_gateway_queue_depth", model="tiny") == 2, what="two held requests")
        joined = register(gateway.url, fake)
        assert joined.status_code == 201 and joined.json()["state"] == "ready"
        plain, streamed = plain.result(), streamed.result()
    assert plain.status_code == 200 and plain.headers["x-ember-replica"] == "r1"
    assert plain.json()["choices"][0]["message"]["content"] == "Hello from r1"
    assert streamed.status_code == 200 and "from" in streamed.text and streamed.text.endswith("data: [DONE]\n\n")
    assert [body["model"] for body in fake.requests] == ["tiny-v1", "tiny-v1"]


def test_past_the_hold_limit_requests_get_429_with_retry_after(gateway, fake):
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        held = [pool.submit(chat, gateway.url) for _ in range(4)]
        wait_until(lambda: gateway.metric("ember_gateway_queue_depth", model="tiny") == 4, what="four held")
        refused = chat(gateway.url)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "queue_full"
        register(gateway.url, fake)
        assert [future.result().status_code for future in held] == [200] * 4


def test_a_replica_joins_routing_only_after_a_successful_probe(gateway, fake):
    fake.health_status = 503
    joined = register(gateway.url, fake)
    assert joined.status_code == 201 and joined.json()["state"] == "loading"
    assert joined.json()["awaiting_first_probe"] and joined.json()["ejection_reason"] is None
    listed = http.get(gateway.url + "/admin/replicas", headers=CONTROL).json()["data"]
    assert [(replica["id"], replica["healthy"]) for replica in listed] == [("r1", False)]
    fake.health_status = 200
    wait_until(lambda: gateway.dispatcher.pool.get("r1").healthy, what="the prober to admit r1")
    assert chat(gateway.url).headers["x-ember-replica"] == "r1"


def test_a_registered_replica_gets_the_api_key_of_its_registration(gateway, fake):
    """How `ember up`'s Ray replicas, which require the fleet's credential, are called by the gateway."""
    assert register(gateway.url, fake, api_key="fleet-credential").status_code == 201
    assert chat(gateway.url).status_code == 200
    assert fake.authorizations["/v1/chat/completions"] == {"Bearer fleet-credential"}


def test_a_leaving_replica_takes_no_new_request_and_answers_once_its_requests_finish(gateway, fake):
    other = FakeReplica("r2").start()
    try:
        register(gateway.url, fake)
        fake.hold()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            in_flight = pool.submit(chat, gateway.url)
            wait_until(lambda: fake.in_flight == 1, what="a request held on r1")
            register(gateway.url, other)
            leaving = pool.submit(http.delete, gateway.url + "/admin/replicas/r1", headers=CONTROL)
            wait_until(lambda: gateway.dispatcher.pool.get("r1") is None, what="r1 out of routing")
            states = {r["id"]: r["state"] for r in http.get(gateway.url + "/admin/replicas", headers=CONTROL).json()["data"]}
            assert states == {"r2": "ready", "r1": "draining"}
            assert [chat(gateway.url).headers["x-ember-replica"] for _ in range(3)] == ["r2"] * 3
            assert not leaving.done()
            fake.release()
            assert in_flight.result().status_code == 200
            left = leaving.result()
        assert left.status_code == 200 and left.json()["state"] == "removed" and left.json()["drained"] is True
        assert [r["id"] for r in http.get(gateway.url + "/admin/replicas", headers=CONTROL).json()["data"]] == ["r2"]
    finally:
        other.stop()


def test_bad_registrations_answer_openai_shaped_errors(gateway, fake):
    unknown = http.post(gateway.url + "/admin/replicas", json={"model": "nope", "url": fake.url}, headers=CONTROL)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    bad_url = http.post(gateway.url + "/admin/replicas", json={"model": "tiny", "url": "ftp://x"}, headers=CONTROL)
    assert bad_url.status_code == 400 and bad_url.json()["error"]["param"] == "url"
    assert register(gateway.url, fake).status_code == 201
    again = register(gateway.url, fake)
    assert again.status_code == 409 and again.json()["error"]["code"] == "replica_exists"
    missing = http.delete(gateway.url + "/admin/replicas/nope", headers=CONTROL)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "replica_not_found"


def test_a_held_stream_gets_keep_alive_comments_until_a_replica_joins(gateway, fake, monkeypatch):
    import ember.gateway.app

    monkeypatch.setattr(ember.gateway.app, "HELD_KEEPALIVE_S", 0.2)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with http.stream("POST", gateway.url + "/v1/chat/completions", json=body, headers=AUTH) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = response.iter_lines()
        assert [next(lines), next(lines)] == [": waiting for a replica to start", ""]
        assert register(gateway.url, fake).status_code == 201
        rest = [line for line in lines if line and not line.startswith(":")]
    assert rest[-1] == "data: [DONE]" and len(rest) == 4  # the three chunks of the fake replica, then [DONE]
    assert "from" in rest[1]


def test_a_held_stream_that_passes_its_deadline_ends_with_an_error_event(gateway, monkeypatch):
    import ember.gateway.app

    monkeypatch.setattr(ember.gateway.app, "HELD_KEEPALIVE_S", 0.2)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    headers = {**AUTH, "x-ember-deadline-ms": "700"}
    response = http.post(gateway.url + "/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200
    events = [line for line in response.text.split("\n\n") if line]
    assert events[0] == ": waiting for a replica to start"
    assert events[-1].startswith("data: ") and '"code":"deadline_exceeded"' in events[-1]
    assert all(event == ": waiting for a replica to start" for event in events[:-1])
