"""`state: {backend: shared}`: two gateways on one PostgreSQL and one Redis enforce each key's limits as one
gateway would (same 429s and headers, same reservations and settlement)."""

from __future__ import annotations

import concurrent.futures

from gateway_harness import gateway_config, http, model_config, wait_until


def chat(gateway, key: str, max_tokens: int = 16):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    return http.post(
        gateway.url + "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )


def two_gateways(start_gateway, replica, state: dict, **policy):
    config = gateway_config(
        {"tiny": model_config(replica)}, [{"name": "k", "secret": "sk-k", **policy}], state=state
    )
    return start_gateway(config), start_gateway(config)


def test_requests_per_minute_are_counted_once_across_gateways(shared_state, replicas, start_gateway):
    a, _ = replicas
    first, second = two_gateways(start_gateway, a, shared_state, rpm=10)
    responses = [chat(first if i % 2 else second, "sk-k") for i in range(14)]
    assert [r.status_code for r in responses] == [200] * 10 + [429] * 4
    assert [r.headers["x-ratelimit-remaining-requests"] for r in responses[:10]] == [
        str(9 - i) for i in range(10)
    ]
    refused = responses[10]
    assert (
        refused.json()["error"]["type"] == "requests"
        and refused.json()["error"]["code"] == "rate_limit_exceeded"
    )
    assert refused.headers["x-ratelimit-limit-requests"] == "10"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert 1 <= int(refused.headers["retry-after"]) <= 6  # 10 rpm refills one request every 6 s
    assert len(a.requests) == 10


def test_concurrency_slots_are_shared(shared_state, replicas, start_gateway):
    a, _ = replicas
    first, second = two_gateways(start_gateway, a, shared_state, max_concurrent=1)
    a.hold()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(chat, first, "sk-k")
        wait_until(lambda: a.in_flight == 1, what="first request at the replica")
        refused = chat(second, "sk-k")
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "concurrency_limit_exceeded"
        assert refused.headers["retry-after"] == "1"
        a.release()
        assert held.result().status_code == 200
    wait_until(lambda: chat(second, "sk-k").status_code == 200, what="the slot released through Redis")


def test_token_estimate_is_corrected_from_usage_across_gateways(shared_state, replicas, start_gateway):
    a, _ = replicas
    first, second = two_gateways(start_gateway, a, shared_state, tpm=1000)
    too_large = chat(first, "sk-k", max_tokens=1200)
    assert too_large.status_code == 429 and "Request too large" in too_large.json()["error"]["message"]
    # Each request is estimated at 605 tokens (4 + ceil(2 / 4) + 600) and the replica reports 10: settling
    # gives 595 back, so the second request fits on the other gateway (1000 - 605 < 605 without it).
    assert chat(first, "sk-k", max_tokens=600).status_code == 200
    wait_until(
        lambda: chat(second, "sk-k", max_tokens=600).status_code == 200, what="the correction in Redis"
    )
    a.usage = {"prompt_tokens": 400, "completion_tokens": 500, "total_tokens": 900}
    assert chat(first, "sk-k", max_tokens=600).status_code == 200  # charged 900 after the fact
    wait_until(lambda: chat(second, "sk-k", max_tokens=600).status_code == 429, what="the 900-token charge")
    refused = chat(first, "sk-k", max_tokens=600)
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "tokens"
    assert int(refused.headers["x-ratelimit-remaining-tokens"]) < 605


def test_usage_endpoint_reports_reservations_held_on_the_other_gateway(shared_state, replicas, start_gateway):
    a, _ = replicas
    first, second = two_gateways(start_gateway, a, shared_state, token_budget=1000)
    a.hold()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(chat, first, "sk-k")
        wait_until(lambda: a.in_flight == 1, what="first request at the replica")
        usage = http.get(second.url + "/v1/usage", headers={"authorization": "Bearer sk-k"}).json()
        assert usage["tokens_reserved"] == 21  # one message: 4 + ceil(2 / 4), plus max_tokens 16
        a.release()
        assert held.result().status_code == 200
    wait_until(
        lambda: (
            http.get(second.url + "/v1/usage", headers={"authorization": "Bearer sk-k"}).json()[
                "tokens_reserved"
            ]
            == 0
        ),
        what="the reservation settled",
    )
