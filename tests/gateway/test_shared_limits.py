"""`state: {backend: shared}`: two gateways on one PostgreSQL and one Redis enforce each key's limits as one
gateway would (same 429s and headers, same reservations and settlement)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import socket
import threading
import urllib.parse

import pytest
import redis
from gateway_harness import gateway_config, http, model_config, wait_until
from shared_stores import REDIS_URL

from ember.gateway.config import KeyPolicy
from ember.gateway.keys import Principal
from ember.gateway.shared.config import StateConfig
from ember.gateway.shared.connection import SharedState
from ember.gateway.shared.ratelimit import SharedRateLimiter
from ember.gateway.usage import UsageLedger


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
    # Accepted once the second request's correction has landed too (settled after its response; a refusal
    # charges nothing), then charged 900 after the fact.
    wait_until(lambda: chat(first, "sk-k", max_tokens=600).status_code == 200, what="the second correction")
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


def test_concurrent_admissions_batched_per_tick_still_take_each_token_once(
    shared_state, replicas, start_gateway
):
    a, _ = replicas
    first, second = two_gateways(start_gateway, a, shared_state, rpm=10)
    # 40 requests at once across both gateways: many are admitted in the same event-loop tick, in one
    # pipelined round trip to Redis, each script still atomic.
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        statuses = list(pool.map(lambda i: chat(first if i % 2 else second, "sk-k").status_code, range(40)))
    assert sorted(statuses) == [200] * 10 + [429] * 30
    assert len(a.requests) == 10


def test_scripts_flushed_from_redis_are_loaded_again(shared_state, replicas, start_gateway):
    a, _ = replicas
    first, _ = two_gateways(start_gateway, a, shared_state, rpm=10)
    assert chat(first, "sk-k").headers["x-ratelimit-remaining-requests"] == "9"
    redis.Redis.from_url(REDIS_URL).script_flush()  # as after a Redis restart: EVALSHA answers NOSCRIPT
    again = chat(first, "sk-k")
    assert again.status_code == 200 and again.headers["x-ratelimit-remaining-requests"] == "8"


class RedisRelay:
    """A TCP relay in front of the test Redis that the test can cut, as a network failure would."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # cut
                return
            upstream = socket.create_connection(self.target)
            self.sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(), which close() would not
        self.listener.close()
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def test_requests_needing_an_unreachable_redis_answer_503_and_pass_nothing(
    shared_state, replicas, start_gateway
):
    a, _ = replicas
    url = urllib.parse.urlsplit(REDIS_URL)
    relay = RedisRelay((url.hostname, url.port or 6379))
    state = {**shared_state, "redis": {**shared_state["redis"], "url": f"redis://127.0.0.1:{relay.port}/0"}}
    first, _ = two_gateways(start_gateway, a, state, rpm=10)
    assert chat(first, "sk-k").status_code == 200
    relay.cut()
    refused = chat(first, "sk-k")
    assert refused.status_code == 503
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "state_unavailable")
    assert "shared state (Redis) is unreachable" in error["message"]
    assert len(a.requests) == 1  # not let through unlimited
    assert first.metric("ember_gateway_rate_limited_total", key="k", limit="service_unavailable") == 0


def test_an_admission_whose_caller_left_gives_its_slot_back_at_once(shared_state):
    """A request cancelled (its client gone) while its admission script is on the way to Redis: the script
    admits it all the same, so its concurrency slot must come back now, not when its lease lapses."""

    async def scenario() -> dict[str, str]:
        state = SharedState(StateConfig.model_validate(shared_state))
        await state.open()
        try:
            limiter = SharedRateLimiter(state, UsageLedger(None))
            principal = Principal("inline:k", "k", KeyPolicy(rpm=10, max_concurrent=1))
            leaving = asyncio.create_task(limiter.admit(principal, 10))
            await asyncio.sleep(0)  # queued in this tick's batch, waiting for its reply
            leaving.cancel()
            with pytest.raises(asyncio.CancelledError):
                await leaving
            leases = f"{shared_state['redis']['key_prefix']}:limits:{{inline:k}}:leases"
            for _ in range(500):
                if await state.redis.zcard(leases) == 0:
                    break
                await asyncio.sleep(0.01)
            admitted = await limiter.admit(principal, 10)  # max_concurrent 1: only if the slot came back
            limiter.settle(admitted, 10)
            await limiter.drain()
            return admitted.headers
        finally:
            await state.close()

    headers = asyncio.run(scenario())
    assert headers["x-ratelimit-remaining-requests"] == "8"  # the abandoned admission took one request
