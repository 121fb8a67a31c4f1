"""Engine priority comes only from the key's tier: the gateway writes the replica body's `priority`
(the engine serves the lowest value first) from the request's tier (higher first) and never forwards
the client's own `priority` field."""

from __future__ import annotations

import asyncio
import re

import httpx
import orjson
import pytest
from gateway_harness import EmberServe, gateway_config, http, model_config, wait_until

KEYS = [
    {"name": "low", "secret": "sk-low", "priority": 0},
    {"name": "high", "secret": "sk-high", "priority": 2},
    {"name": "flex", "secret": "sk-flex", "priority": 1, "max_priority": 3},
]


def complete(gateway, key: str, body_extra: dict, **headers: str) -> httpx.Response:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, **body_extra}
    return http.post(gateway.url + "/v1/completions", json=body, headers={"authorization": f"Bearer {key}", **headers})


@pytest.mark.parametrize(
    ("key", "body_extra", "headers", "engine_priority"),
    [
        ("sk-low", {"priority": -1000}, {}, 0),  # the client's value is overwritten by its tier's
        ("sk-low", {"priority": 1000}, {}, 0),
        ("sk-high", {}, {}, -2),  # tier 2 -> engine priority -2: served before tier 0
        ("sk-high", {"priority": 7, "stream": True}, {}, -2),  # streams too
        ("sk-flex", {"priority": -1000}, {"x-ember-priority": "9"}, -3),  # capped at max_priority 3
        ("sk-high", {}, {"x-ember-priority": "0"}, 0),  # a key may always lower itself
    ],
)
def test_the_replica_gets_the_tiers_engine_priority_never_the_clients(
    replicas, start_gateway, key, body_extra, headers, engine_priority
):
    a, _ = replicas
    gateway = start_gateway(gateway_config({"tiny": model_config(a)}, KEYS))
    response = complete(gateway, key, body_extra, **headers)
    assert response.status_code == 200
    assert a.requests[-1].get("priority", 0) == engine_priority  # absent: the engine's default, 0


def test_tier_zero_without_a_body_priority_is_forwarded_as_sent(replicas, start_gateway):
    a, _ = replicas
    gateway = start_gateway(gateway_config({"tiny": model_config(a)}, KEYS))
    assert complete(gateway, "sk-low", {}).status_code == 200
    assert "priority" not in a.requests[-1]  # the engine's default, 0, is tier 0's priority


def test_async_jobs_run_below_every_tier_on_the_replica(held_gateway):
    gateway, replica = held_gateway
    response = http.post(
        gateway.url + "/v1/async/completions",
        headers={"authorization": "Bearer sk-test-alpha"},
        json={"model": "tiny", "prompt": "hi", "max_tokens": 4, "priority": 2},
    )
    assert response.status_code == 202, response.text
    wait_until(lambda: len(replica.requests) == 1, what="the job at the replica")
    # Job priority 2 is the most urgent job, but every job runs at tier -1: engine priority 1.
    assert replica.requests[0]["priority"] == 1


# --- a real replica whose own queue is saturated ----------------------------------------------------


@pytest.fixture(scope="module")
def one_seq_replica(long_context_model_dir):
    """One engine slot (max_num_seqs 1) behind a gateway that allows 8: requests queue in the engine,
    where its priority decides who runs next. The long context lets one request hold the slot."""
    replica = EmberServe(long_context_model_dir, "r1", max_num_seqs=1, max_model_len=16384)
    try:
        yield replica.start()
    finally:
        replica.kill()


WAITING = re.compile(r"^vllm:num_requests_waiting(?:\{[^}]*\})? (\S+)$", re.MULTILINE)


async def engine_waiting(client: httpx.AsyncClient, replica: EmberServe) -> int:
    metrics = (await client.get(replica.url + "/metrics")).text
    return int(float(WAITING.search(metrics).group(1)))


@pytest.mark.slow
def test_a_low_tier_body_priority_does_not_overtake_a_high_tier_in_the_engine(one_seq_replica, start_gateway):
    model = {"deployments": [{"replicas": [{"url": one_seq_replica.url, "id": "r1", "capacity": 8}]}]}
    health = {"interval_s": 1, "timeout_s": 5, "unhealthy_threshold": 3, "healthy_threshold": 1}
    gateway = start_gateway(gateway_config({"tiny": model}, KEYS, health=health))
    first_tokens: list[str] = []
    finished: list[str] = []

    async def run() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            occupant_running = asyncio.Event()

            async def stream(key: str, tag: str, max_tokens: int, **extra) -> None:
                body = {
                    "model": "tiny", "prompt": tag, "max_tokens": max_tokens, "ignore_eos": True,
                    "temperature": 0, "stream": True, **extra,
                }  # fmt: skip
                headers = {"authorization": f"Bearer {key}"}
                async with client.stream("POST", gateway.url + "/v1/completions", json=body, headers=headers) as response:
                    assert response.status_code == 200, await response.aread()
                    async for line in response.aiter_lines():
                        if line.startswith("data: {") and "choices" in orjson.loads(line[6:]):
                            if tag == "occupant":
                                occupant_running.set()
                            elif tag not in first_tokens:
                                first_tokens.append(tag)
                finished.append(tag)

            # A long request takes the engine's only slot; the client drops it once the others wait.
            occupant = asyncio.create_task(stream("sk-low", "occupant", 15000))
            await asyncio.wait_for(occupant_running.wait(), 240)
            queued = []
            # The low tier arrives first and asks the engine for priority -1000 in its body.
            order = [("sk-low", "low-1"), ("sk-low", "low-2"), ("sk-high", "high-1"), ("sk-high", "high-2")]
            for index, (key, tag) in enumerate(order):
                queued.append(asyncio.create_task(stream(key, tag, 8, priority=-1000)))
                while await engine_waiting(client, one_seq_replica) < index + 1:
                    assert not queued[-1].done(), queued[-1].exception()
                    await asyncio.sleep(0.02)
            assert not occupant.done(), "the occupant finished before the others queued"
            occupant.cancel()
            await asyncio.gather(*queued)

    asyncio.run(run())
    assert first_tokens == ["high-1", "high-2", "low-1", "low-2"]
    assert finished == ["high-1", "high-2", "low-1", "low-2"]
