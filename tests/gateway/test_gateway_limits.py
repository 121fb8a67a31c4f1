"""Per-key limits: RPM/TPM token buckets with OpenAI's headers, concurrency, token budgets, usage."""

from __future__ import annotations

import concurrent.futures

import httpx
from gateway_harness import gateway_config, http, model_config, wait_until


def chat(gateway, key: str, max_tokens: int = 16, content: str = "hi") -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    return http.post(
        gateway.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=30
    )


def test_requests_per_minute(replicas, start_gateway):
    a, _ = replicas
    gateway = start_gateway(gateway_config({"tiny": model_config(a)}, [{"name": "k", "secret": "sk-k", "rpm": 2}]))
    first, second, third = (chat(gateway, "sk-k") for _ in range(3))
    assert first.status_code == second.status_code == 200
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert second.headers["x-ratelimit-remaining-requests"] == "0"
    assert third.status_code == 429
    assert 1 <= int(third.headers["retry-after"]) <= 30  # at 2 rpm one request refills within 30 s
    assert third.headers["x-ratelimit-limit-requests"] == "2"
    assert third.headers["x-ratelimit-remaining-requests"] == "0"
    assert third.headers["x-ratelimit-reset-requests"].endswith("s")
    error = third.json()["error"]
    assert error["type"] == "requests" and error["code"] == "rate_limit_exceeded"
    assert len(a.requests) == 2
    assert gateway.metric("ember_gateway_rate_limited_total", key="k", limit="requests") == 1


def test_tokens_per_minute_is_estimated_then_corrected_from_usage(replicas, start_gateway):
    a, _ = replicas
    gateway = start_gateway(gateway_config({"tiny": model_config(a)}, [{"name": "k", "secret": "sk-k", "tpm": 1000}]))
    too_large = chat(gateway, "sk-k", max_tokens=1200)
    assert too_large.status_code == 429 and "Request too large" in too_large.json()["error"]["message"]
    # Estimate: one message (4 + ceil(2 / 4)) + 600 = 605 tokens; the replica reports 10, so the bucket
    # gets 595 back and the next request fits (it would not without the correction: 1000 - 605 < 605).
    first = chat(gateway, "sk-k", max_tokens=600)
    assert first.status_code == 200 and first.headers["x-ratelimit-limit-tokens"] == "1000"
    assert int(first.headers["x-ratelimit-remaining-tokens"]) < 605
    assert chat(gateway, "sk-k", max_tokens=600).status_code == 200
    a.usage = {"prompt_tokens": 400, "completion_tokens": 500, "total_tokens": 900}
    assert chat(gateway, "sk-k", max_tokens=600).status_code == 200  # charged 900 after the fact
    refused = chat(gateway, "sk-k", max_tokens=600)
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "tokens"
    assert int(refused.headers["x-ratelimit-remaining-tokens"]) < 605
    assert int(refused.headers["retry-after"]) >= 1
    assert len(a.requests) == 3


def test_max_concurrent_requests(replicas, start_gateway):
    a, _ = replicas
    gateway = start_gateway(
        gateway_config({"tiny": model_config(a)}, [{"name": "k", "secret": "sk-k", "max_concurrent": 1}])
    )
    a.hold()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(chat, gateway, "sk-k")
        wait_until(lambda: a.in_flight == 1, what="first request at the replica")
        refused = chat(gateway, "sk-k")
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "concurrency_limit_exceeded"
        a.release()
        assert held.result().status_code == 200
    assert chat(gateway, "sk-k").status_code == 200


def test_token_budget_and_usage_endpoint(replicas, start_gateway):
    a, _ = replicas
    gateway = start_gateway(
        gateway_config({"tiny": model_config(a)}, [{"name": "k", "secret": "sk-k", "token_budget": 40}])
    )
    # Each request is estimated at 21 tokens (one message: 4 + ceil(2 / 4), plus max_tokens 16) and
    # the replica reports 10: admitted while used + estimate fits the budget.
    assert chat(gateway, "sk-k").status_code == 200  # 0 + 21 <= 40; 10 used
    assert chat(gateway, "sk-k").status_code == 200  # 10 + 21 <= 40; 20 used
    refused = chat(gateway, "sk-k")  # 20 + 21 > 40
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "insufficient_quota"
    assert "has 20 of its token budget of 40 tokens left" in refused.json()["error"]["message"]
    assert chat(gateway, "sk-k", max_tokens=10).status_code == 200  # 20 + 15 <= 40: a smaller one fits
    spent = chat(gateway, "sk-k", max_tokens=1)  # 30 + 6 <= 40; now 40 used
    assert spent.status_code == 200
    used_up = chat(gateway, "sk-k", max_tokens=1)
    assert used_up.status_code == 429
    assert used_up.json()["error"]["message"] == "API key 'k' has used its token budget of 40 tokens."
    usage = http.get(gateway.url + "/v1/usage", headers={"authorization": "Bearer sk-k"}).json()
    assert usage["key"] == "k"
    assert (usage["requests"], usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        4, 28, 12, 40,
    )  # fmt: skip
    assert usage["token_budget"] == 40 and usage["budget_remaining"] == 0 and usage["tokens_reserved"] == 0
    assert gateway.metric("ember_gateway_tokens_total", key="k", kind="completion") == 12


def test_usage_survives_a_restart_with_a_key_store(replicas, start_gateway, tmp_path):
    a, _ = replicas
    config = gateway_config({"tiny": model_config(a)}, [{"name": "k", "secret": "sk-k", "token_budget": 40}])
    config["keys"]["store"] = "keys.db"
    first = start_gateway(config)
    assert chat(first, "sk-k").status_code == 200
    assert chat(first, "sk-k").status_code == 200
    first.server.stop()  # shutdown flushes the usage counters to the store
    second = start_gateway(config)
    assert chat(second, "sk-k").status_code == 429  # 20 used + an estimate of 21 > 40
