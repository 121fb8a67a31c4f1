"""Failover before the first byte, clean endings after it, passive and active ejection, re-admission."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
from gateway_harness import FakeReplica, free_port, gateway_config, http, wait_until

KEY = {"name": "ci", "secret": "sk-ci"}
AUTH = {"authorization": "Bearer sk-ci"}
SLOW_PROBES = {"interval_s": 60, "timeout_s": 0.5, "unhealthy_threshold": 3, "healthy_threshold": 1}


def two_replica_model(first_url: str, second_url: str, policy: str = "round-robin") -> dict:
    replicas = [{"url": first_url, "id": "first"}, {"url": second_url, "id": "second"}]
    return {"routing": {"policy": policy}, "deployments": [{"replicas": replicas}]}


def chat(gateway, stream: bool = False) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    return http.post(gateway.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=30)


def test_connection_refused_is_retried_and_the_replica_ejected(start_gateway):
    dying, live = FakeReplica("dying").start(), FakeReplica("live").start()
    try:
        config = gateway_config(
            {"tiny": two_replica_model(dying.url, live.url)}, [dict(KEY)], health=SLOW_PROBES
        )
        gateway = start_gateway(config)  # both admitted by the first round of probes
        dying.stop()  # the next probe is a minute away: only a request can find it gone
        responses = [chat(gateway), chat(gateway, stream=True), chat(gateway), chat(gateway, stream=True)]
        assert [response.status_code for response in responses] == [200] * 4
        assert all(response.headers["x-ember-replica"] == "second" for response in responses)
        assert len(live.requests) == 4
        assert gateway.metric("ember_gateway_retries_total", model="tiny", reason="connect_error") == 1
        assert gateway.metric("ember_gateway_ejections_total", replica="first", reason="connect_error") == 1
        assert not gateway.dispatcher.pool.get("first").healthy
    finally:
        live.stop()


def test_5xx_is_retried_on_another_replica_and_all_failing_gives_502(start_gateway):
    failing, healthy = FakeReplica("failing").start(), FakeReplica("healthy").start()
    try:
        failing.fail_status = 500
        config = gateway_config(
            {"tiny": two_replica_model(failing.url, healthy.url)}, [dict(KEY)], health=SLOW_PROBES
        )
        gateway = start_gateway(config)
        responses = [chat(gateway) for _ in range(4)]
        assert [response.status_code for response in responses] == [200] * 4
        assert {response.json()["system_fingerprint"] for response in responses} == {"healthy"}
        assert len(failing.requests) >= 1
        assert gateway.metric("ember_gateway_retries_total", model="tiny", reason="http_500") == len(
            failing.requests
        )
        healthy.fail_status = 503
        everything_fails = chat(gateway)
        assert everything_fails.status_code == 502
        error = everything_fails.json()["error"]
        assert error["code"] == "upstream_error"
        assert error["message"].endswith("replica(s) failed before responding (last: HTTP 503).")
    finally:
        failing.stop()
        healthy.stop()


def test_client_errors_are_passed_through_not_retried(start_gateway):
    first, second = FakeReplica("first").start(), FakeReplica("second").start()
    try:
        first.fail_status = second.fail_status = 422
        gateway = start_gateway(
            gateway_config({"tiny": two_replica_model(first.url, second.url)}, [dict(KEY)])
        )
        response = chat(gateway)
        assert response.status_code == 422
        assert response.json()["error"]["message"].endswith("fails")
        assert len(first.requests) + len(second.requests) == 1
    finally:
        first.stop()
        second.stop()


def test_a_replica_dying_mid_stream_ends_the_stream_with_an_error_then_done(start_gateway):
    replica = FakeReplica("fragile").start()
    try:
        replica.die_after_chunks = 1
        models = {"tiny": {"deployments": [{"replicas": [{"url": replica.url, "id": "fragile"}]}]}}
        gateway = start_gateway(gateway_config(models, [dict(KEY)], health=SLOW_PROBES))
        response = chat(gateway, stream=True)
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
        assert len(events) == 3
        assert orjson.loads(events[0])["choices"][0]["delta"]["content"] == "Hello"
        error = orjson.loads(events[1])["error"]
        assert error["type"] == "server_error" and error["code"] == "upstream_stream_error"
        assert events[2] == "[DONE]"
        assert gateway.dispatcher.pool.get("fragile").outstanding == 0
    finally:
        replica.stop()


def test_a_stream_left_silent_on_an_ejected_replica_ends_with_an_error_then_done(start_gateway):
    replica = FakeReplica("silent").start()
    try:
        replica.pause_after_first_chunk = True  # the first chunk, then nothing (a partition, a hung host)
        models = {"tiny": {"deployments": [{"replicas": [{"url": replica.url, "id": "silent"}]}]}}
        probes = {"interval_s": 0.2, "timeout_s": 0.5, "unhealthy_threshold": 2, "healthy_threshold": 1}
        gateway = start_gateway(gateway_config(models, [dict(KEY)], health=probes))
        with ThreadPoolExecutor(1) as pool:
            streaming = pool.submit(chat, gateway, True)
            wait_until(
                lambda: gateway.metric("ember_gateway_time_to_first_token_seconds_count", model="tiny") == 1,
                what="the stream's first chunk at the gateway",
            )
            replica.health_status = 503  # probes fail: ejected; the stream still has had nothing since
            response = streaming.result(timeout=30)  # well before timeouts.read_s (120 s)
        events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
        assert orjson.loads(events[0])["choices"][0]["delta"]["content"] == "Hello"
        error = orjson.loads(events[1])["error"]
        assert error["code"] == "upstream_stream_error" and "since it was ejected" in error["message"]
        assert events[2:] == ["[DONE]"]
        assert gateway.dispatcher.pool.get("silent").outstanding == 0
        assert (
            gateway.metric(
                "ember_gateway_requests_total",
                model="tiny",
                key="ci",
                replica="silent",
                status="stream_error",
            )
            == 1
        )
    finally:
        replica.release()
        replica.stop()


def test_health_probes_eject_and_readmit(start_gateway):
    flaky, steady = FakeReplica("flaky").start(), FakeReplica("steady").start()
    try:
        config = gateway_config({"tiny": two_replica_model(flaky.url, steady.url)}, [dict(KEY)])
        gateway = start_gateway(config)  # probes every 0.2 s, 2 failures eject, 1 success re-admits
        replica = gateway.dispatcher.pool.get("first")
        flaky.health_status = 503
        wait_until(lambda: not replica.healthy, what="ejection")
        assert {chat(gateway).headers["x-ember-replica"] for _ in range(4)} == {"second"}
        ready = http.get(gateway.url + "/ready").json()
        assert ready["healthy_replicas"] == {"tiny": 1}
        flaky.health_status = 200
        wait_until(lambda: replica.healthy, what="re-admission")
        assert gateway.metric("ember_gateway_ejections_total", replica="first", reason="health_probe") == 1
        assert gateway.metric("ember_gateway_readmissions_total", replica="first") == 1
        assert {chat(gateway).headers["x-ember-replica"] for _ in range(4)} == {"first", "second"}
    finally:
        flaky.stop()
        steady.stop()


def test_no_healthy_replica_is_a_503(start_gateway):
    dying = FakeReplica("dying").start()
    models = {"tiny": {"deployments": [{"replicas": [{"url": dying.url, "id": "dead"}]}]}}
    gateway = start_gateway(gateway_config(models, [dict(KEY)], health=SLOW_PROBES))
    dying.stop()
    first = chat(gateway)
    assert first.status_code == 502  # tried, refused, ejected, nothing else to try
    second = chat(gateway)
    assert second.status_code == 503
    assert second.json()["error"]["code"] == "no_healthy_replica"


def test_a_replica_is_sent_nothing_before_its_first_successful_probe(start_gateway):
    loading = FakeReplica("loading").start()
    loading.health_status = 503  # up, but its model not loaded yet
    try:
        models = {"tiny": {"deployments": [{"replicas": [{"url": loading.url, "id": "loading"}]}]}}
        gateway = start_gateway(gateway_config(models, [dict(KEY)]))  # probes every 0.2 s
        replica = gateway.dispatcher.pool.get("loading")
        assert not replica.healthy and replica.awaiting_first_probe
        ready = http.get(gateway.url + "/ready")
        assert ready.status_code == 503 and ready.json()["healthy_replicas"] == {"tiny": 0}

        # Past its deadline, a request that waited for the replica gets the no-replica answer.
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        late = http.post(
            gateway.url + "/v1/chat/completions", json=body, headers={**AUTH, "x-ember-deadline-ms": "300"}
        )
        assert late.status_code == 503
        assert late.json()["error"]["code"] == "no_healthy_replica"
        # One that arrives now waits in the queue, then is served once a probe passes.
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(chat, gateway)
            wait_until(lambda: gateway.dispatcher.queue.depth("tiny") == 1, what="the request to queue")
            assert loading.requests == []  # nothing reached the replica that has not answered a probe
            loading.health_status = 200
            served = waiting.result(timeout=30)
        assert served.status_code == 200 and served.headers["x-ember-replica"] == "loading"
        assert len(loading.requests) == 1
        assert not replica.awaiting_first_probe
        # Admission is not a re-admission, and never having answered was not an ejection.
        assert gateway.metric("ember_gateway_readmissions_total", replica="loading") == 0
        assert gateway.metric("ember_gateway_ejections_total", replica="loading", reason="health_probe") == 0
    finally:
        loading.stop()


def test_a_failover_retry_does_not_wait_for_a_replica_that_never_answered(start_gateway):
    failing = FakeReplica("failing").start()
    failing.fail_status = 500
    try:
        never_up = f"http://127.0.0.1:{free_port()}"
        config = gateway_config(
            {"tiny": two_replica_model(failing.url, never_up)}, [dict(KEY)], health=SLOW_PROBES
        )
        gateway = start_gateway(config)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        # The deadline is beyond the client's 30 s timeout: only an answer that does not wait for "second" passes.
        response = http.post(gateway.url + "/v1/chat/completions", json=body, headers={**AUTH, "x-ember-deadline-ms": "120000"},
                             timeout=30)  # fmt: skip
        assert response.status_code == 502
        assert response.json()["error"]["message"].endswith(
            "1 replica(s) failed before responding (last: HTTP 500)."
        )
        assert len(failing.requests) == 1
    finally:
        failing.stop()


def test_pooled_connections_a_restarted_replica_closed_are_not_failures(start_gateway):
    replica = FakeReplica("bouncy").start()
    try:
        models = {"tiny": {"deployments": [{"replicas": [{"url": replica.url, "id": "bouncy"}]}]}}
        gateway = start_gateway(gateway_config(models, [dict(KEY)], health=SLOW_PROBES))
        assert chat(gateway).status_code == 200  # leaves a kept-alive connection in the pool
        replica.stop()
        replica.start()  # same port; the pooled connection is now closed by its peer
        assert chat(gateway).status_code == 200
        assert gateway.metric("ember_gateway_retries_total", model="tiny", reason="disconnected") == 0
        assert gateway.metric("ember_gateway_ejections_total", replica="bouncy", reason="disconnected") == 0
        assert gateway.dispatcher.pool.get("bouncy").healthy
    finally:
        replica.stop()


def test_an_error_other_than_an_oserror_before_the_first_byte_is_retried_on_another_replica(start_gateway):
    first, second = FakeReplica("first").start(), FakeReplica("second").start()
    try:
        config = gateway_config(
            {"tiny": two_replica_model(first.url, second.url)}, [dict(KEY)], health=SLOW_PROBES
        )
        gateway = start_gateway(config)  # both admitted by the first round of probes
        # An address the client refuses with a ValueError (port out of range), not a connection error.
        broken = gateway.dispatcher.pool.get("first")
        gateway.server.call(lambda: setattr(broken, "url", "http://127.0.0.1:70000"))
        responses = [chat(gateway), chat(gateway, stream=True), chat(gateway), chat(gateway, stream=True)]
        assert [response.status_code for response in responses] == [200] * 4
        assert {response.headers["x-ember-replica"] for response in responses} == {"second"}
        assert len(second.requests) == 4
        assert gateway.metric("ember_gateway_retries_total", model="tiny", reason="error") >= 1
    finally:
        first.stop()
        second.stop()
