"""Quotas that hold under bursts: every prompt and choice is estimated, the estimate is reserved
against the token budget and the TPM bucket at admission, settled from the replica's usage, and
released when a request fails or its client leaves."""

from __future__ import annotations

import asyncio
import concurrent.futures

import httpx
import pytest
from gateway_harness import EmberServe, gateway_config, http, model_config, wait_until

from ember.gateway.token_estimate import estimate_request_tokens

DEFAULT_MAX_TOKENS = 256


@pytest.mark.parametrize(
    ("endpoint", "body", "expected"),
    [
        # A string prompt at four characters per token, plus max_tokens.
        ("completions", {"prompt": "abcdefghi", "max_tokens": 10}, 3 + 10),
        # Every prompt of a list counts, each with its own max_tokens.
        ("completions", {"prompt": ["abcd", "abcdefgh", "a"], "max_tokens": 10}, (1 + 2 + 1) + 3 * 10),
        # Token-id prompts count exactly: one prompt of ids, or a list of them.
        ("completions", {"prompt": [5, 6, 7, 8, 9], "max_tokens": 10}, 5 + 10),
        ("completions", {"prompt": [[5, 6], [7, 8, 9], "abcd"], "max_tokens": 10}, (2 + 3 + 1) + 3 * 10),
        # n and best_of multiply the completion part, per prompt.
        ("completions", {"prompt": ["ab", "cd"], "max_tokens": 10, "n": 3}, 2 + 2 * 3 * 10),
        ("completions", {"prompt": "ab", "max_tokens": 10, "n": 2, "best_of": 4}, 1 + 4 * 10),
        # max_completion_tokens wins over max_tokens; neither -> the configured default.
        ("completions", {"prompt": "ab", "max_tokens": 10, "max_completion_tokens": 20}, 1 + 20),
        ("completions", {"prompt": "ab"}, 1 + DEFAULT_MAX_TOKENS),
        # Chat: every message's text plus its template overhead, text parts included.
        (
            "chat/completions",
            {
                "messages": [
                    {"role": "system", "content": "abcdefgh"},
                    {"role": "user", "content": [{"type": "text", "text": "abcd"}, {"type": "image_url"}]},
                ],
                "max_tokens": 10,
                "n": 2,
            },
            (4 + 2) + (4 + 1) + 2 * 10,
        ),
        # Malformed fields count as absent (the replica answers them with its own 400).
        ("completions", {"prompt": {"x": 1}, "max_tokens": "ten", "n": True}, 0 + DEFAULT_MAX_TOKENS),
        ("chat/completions", {"messages": "hi", "max_tokens": -1}, 0 + DEFAULT_MAX_TOKENS),
    ],
)
def test_estimate_counts_every_prompt_and_choice(endpoint: str, body: dict, expected: int):
    assert estimate_request_tokens(endpoint, body, DEFAULT_MAX_TOKENS) == expected


def one_key_gateway(start_gateway, replica, *, policy: dict, **extra):
    """A gateway in front of `replica` with key k (secret sk-k) under `policy`."""
    return start_gateway(gateway_config({"tiny": model_config(replica)}, [{"name": "k", "secret": "sk-k", **policy}], **extra))


def complete(gateway, key: str, prompt, max_tokens: int, **extra) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, **extra}
    return http.post(gateway.url + "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})


def usage(gateway, key: str) -> dict:
    return http.get(gateway.url + "/v1/usage", headers={"authorization": f"Bearer {key}"}).json()


# Ten token ids + max_tokens 20: each request below is estimated at exactly 30 tokens.
IDS = list(range(10, 20))


def test_concurrent_requests_cannot_spend_the_same_budget(replicas, start_gateway):
    a, _ = replicas
    gateway = one_key_gateway(start_gateway, a, policy={"token_budget": 100})
    a.hold()
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        held = [pool.submit(complete, gateway, "sk-k", IDS, 20) for _ in range(3)]
        wait_until(lambda: a.in_flight == 3, what="three requests at the replica")
        assert usage(gateway, "sk-k")["tokens_reserved"] == 90
        # Nothing is spent yet, but 90 of the 100 tokens are promised to the requests in flight.
        refused = complete(gateway, "sk-k", IDS, 20)
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert error["code"] == "insufficient_quota" and error["type"] == "insufficient_quota"
        assert "has 10 of its token budget of 100 tokens left (90 reserved" in error["message"]
        a.release()
        assert [future.result().status_code for future in held] == [200, 200, 200]
    after = usage(gateway, "sk-k")
    assert after["total_tokens"] == 30 and after["tokens_reserved"] == 0  # the fake replica reports 10 each
    assert complete(gateway, "sk-k", IDS, 20).status_code == 200  # the settled budget is free again
    assert len(a.requests) == 4


def test_the_tpm_bucket_reserves_every_prompt(replicas, start_gateway):
    a, _ = replicas
    gateway = one_key_gateway(start_gateway, a, policy={"tpm": 1000})
    # 32 prompts x max_tokens 40 = 1280 completion tokens alone: larger than the whole minute.
    too_large = complete(gateway, "sk-k", [IDS] * 32, 40)
    assert too_large.status_code == 429 and "about 1600 tokens" in too_large.json()["error"]["message"]
    a.hold()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # 8 x (10 + 40) = 400 each: two fit the minute's 1000 tokens together, a third does not.
        held = [pool.submit(complete, gateway, "sk-k", [IDS] * 8, 40) for _ in range(2)]
        wait_until(lambda: a.in_flight == 2, what="two requests at the replica")
        third = complete(gateway, "sk-k", [IDS] * 8, 40)
        assert third.status_code == 429 and third.json()["error"]["type"] == "tokens"
        assert int(third.headers["x-ratelimit-remaining-tokens"]) < 400
        a.release()
        assert [future.result().status_code for future in held] == [200, 200]


def test_failed_requests_release_their_reservation(replicas, start_gateway):
    a, _ = replicas
    health = {"interval_s": 0.1, "timeout_s": 0.5, "unhealthy_threshold": 1, "healthy_threshold": 1}
    gateway = one_key_gateway(start_gateway, a, policy={"token_budget": 90}, health=health)
    a.fail_status = 500
    failed = complete(gateway, "sk-k", IDS, 20)
    assert failed.status_code == 502 and failed.json()["error"]["code"] == "upstream_error"
    assert usage(gateway, "sk-k")["tokens_reserved"] == 0
    a.fail_status = None
    a.die_after_chunks = 1  # the replica dies mid-stream: an error event ends the stream
    wait_until(lambda: gateway.dispatcher.pool.get(a.name).healthy, what="the replica re-admitted")
    with http.stream(
        "POST", gateway.url + "/v1/completions", headers={"authorization": "Bearer sk-k"},
        json={"model": "tiny", "prompt": IDS, "max_tokens": 20, "stream": True},
    ) as response:  # fmt: skip
        body = response.read().decode()
    assert response.status_code == 200 and "upstream_stream_error" in body
    assert usage(gateway, "sk-k")["tokens_reserved"] == 0
    a.die_after_chunks = None
    wait_until(lambda: gateway.dispatcher.pool.get(a.name).healthy, what="the replica re-admitted")
    # Neither failure spent anything: the whole budget is still there, three requests of 30.
    assert [complete(gateway, "sk-k", IDS, 20).status_code for _ in range(3)] == [200, 200, 200]
    assert usage(gateway, "sk-k")["total_tokens"] == 30


def test_a_client_leaving_mid_stream_releases_its_reservation(replicas, start_gateway):
    a, _ = replicas
    gateway = one_key_gateway(start_gateway, a, policy={"token_budget": 30})
    a.pause_after_first_chunk = True
    with http.stream(
        "POST", gateway.url + "/v1/completions", headers={"authorization": "Bearer sk-k"},
        json={"model": "tiny", "prompt": IDS, "max_tokens": 20, "stream": True},
    ) as response:  # fmt: skip
        assert response.status_code == 200
        lines = response.iter_lines()  # kept open: a dropped iterator closes the response
        assert next(lines).startswith("data: ")
        assert usage(gateway, "sk-k")["tokens_reserved"] == 30
    wait_until(lambda: usage(gateway, "sk-k")["tokens_reserved"] == 0, what="the reservation released")
    a.release()
    assert complete(gateway, "sk-k", IDS, 20).status_code == 200


# --- against a real tiny-model replica ------------------------------------------------------------


@pytest.fixture(scope="module")
def real_replica(tiny_model_dir):
    replica = EmberServe(tiny_model_dir, "r1", max_num_seqs=8)
    try:
        yield replica.start()
    finally:
        replica.kill()


def real_fleet(replica: EmberServe, keys: list[dict]) -> dict:
    model = {"deployments": [{"replicas": [{"url": replica.url, "id": replica.name, "capacity": 8}]}]}
    health = {"interval_s": 1, "timeout_s": 5, "unhealthy_threshold": 3, "healthy_threshold": 1}
    return gateway_config({"tiny": model}, keys, health=health, queue={"default_deadline_ms": 300_000})


# A request of eight text prompts and one of eight token-id prompts; with max_tokens 40 and
# ignore_eos each generates 320 tokens and is estimated at 8 x 40 + its prompts.
TEXT_PROMPTS = ["Once upon a time", "The quick brown fox", "In the beginning", "Tell me about"] * 2
ID_PROMPTS = [[100 + i, 200 + i, 300 + i, 400 + i] for i in range(8)]
LARGEST_ESTIMATE = max(
    estimate_request_tokens("completions", {"prompt": prompts, "max_tokens": 40}, DEFAULT_MAX_TOKENS)
    for prompts in (TEXT_PROMPTS, ID_PROMPTS)
)


async def burst(gateway, key: str, prompt_lists: list[list]) -> list[httpx.Response]:
    """One request per prompt list, all at once."""
    async with httpx.AsyncClient(timeout=120, headers={"authorization": f"Bearer {key}"}) as client:
        return await asyncio.gather(
            *(
                client.post(
                    gateway.url + "/v1/completions",
                    json={"model": "tiny", "prompt": prompts, "max_tokens": 40, "ignore_eos": True, "temperature": 0},
                )
                for prompts in prompt_lists
            )
        )


@pytest.mark.slow
def test_bursts_against_a_real_replica_stay_within_the_budget(real_replica, start_gateway):
    keys = [
        {"name": "budget", "secret": "sk-budget", "token_budget": 1500},
        {"name": "issue", "secret": "sk-issue", "tpm": 1000, "token_budget": 1500},
    ]
    gateway = start_gateway(real_fleet(real_replica, keys))
    statuses: list[int] = []
    while not statuses or 200 in statuses[-3:]:  # until a whole burst is refused
        responses = asyncio.run(burst(gateway, "sk-budget", [TEXT_PROMPTS, ID_PROMPTS, TEXT_PROMPTS]))
        for response in responses:
            assert response.status_code in (200, 429), response.text
            if response.status_code == 200:
                assert response.json()["usage"]["completion_tokens"] == 8 * 40
            else:
                assert response.json()["error"]["code"] == "insufficient_quota"
        statuses += [response.status_code for response in responses]
    spent = usage(gateway, "sk-budget")
    assert statuses.count(200) >= 3  # the budget was spent, not refused from the start
    assert spent["total_tokens"] <= 1500 + LARGEST_ESTIMATE
    assert spent["tokens_reserved"] == 0
    assert spent["completion_tokens"] == statuses.count(200) * 8 * 40

    # The burst: 3 concurrent requests of 32 prompts and max_tokens 40 each against
    # --tpm 1000 --token-budget 1500; every one is larger than a minute's tokens.
    responses = asyncio.run(burst(gateway, "sk-issue", [TEXT_PROMPTS * 4, ID_PROMPTS * 4, TEXT_PROMPTS * 4]))
    assert [response.status_code for response in responses] == [429, 429, 429]
    assert usage(gateway, "sk-issue")["total_tokens"] == 0
    # Requests that fit the TPM bucket: 2 of a burst of 3 (2 x 352 of 1000).
    responses = asyncio.run(burst(gateway, "sk-issue", [ID_PROMPTS, ID_PROMPTS, ID_PROMPTS]))
    assert sorted(response.status_code for response in responses) == [200, 200, 429]
    assert usage(gateway, "sk-issue")["total_tokens"] <= 1500


@pytest.mark.slow
def test_a_client_leaving_a_real_stream_releases_its_reservation(real_replica, start_gateway):
    gateway = start_gateway(real_fleet(real_replica, [{"name": "k", "secret": "sk-k", "token_budget": 400}]))
    body = {"model": "tiny", "prompt": ID_PROMPTS, "max_tokens": 40, "ignore_eos": True, "stream": True}
    with http.stream(
        "POST", gateway.url + "/v1/completions", json=body, headers={"authorization": "Bearer sk-k"}
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # kept open: a dropped iterator closes the response
        assert next(lines).startswith("data: ")
        assert usage(gateway, "sk-k")["tokens_reserved"] == 8 * 4 + 8 * 40
    wait_until(lambda: usage(gateway, "sk-k")["tokens_reserved"] == 0, what="the reservation released")
    # The budget (400) still admits a whole request of the same size (352).
    done = http.post(
        gateway.url + "/v1/completions", json={**body, "stream": False}, headers={"authorization": "Bearer sk-k"}
    )
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 8 * 40
