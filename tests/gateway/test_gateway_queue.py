"""Who waits: the per-model priority queue in front of saturated replicas."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import httpx
from gateway_harness import gateway_config, model_config, wait_until

from ember.gateway.admission_queue import AdmissionQueue
from ember.gateway.metrics import GatewayMetrics
from ember.gateway.replicas import Replica, ReplicaPool

KEYS = [
    {"name": "low", "secret": "sk-low", "priority": 0},
    {"name": "high", "secret": "sk-high", "priority": 2},
    {"name": "flex", "secret": "sk-flex", "priority": 1, "max_priority": 3},
    {"name": "patient", "secret": "sk-patient", "default_deadline_ms": 150},
]


def chat(gateway, key: str, tag: str, timeout: float = 60, **headers: str) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": tag}]}
    headers = {"authorization": f"Bearer {key}", **{k.replace("_", "-"): v for k, v in headers.items()}}
    return httpx.post(gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=timeout)


def tags(replica) -> list[str]:
    return [request["messages"][0]["content"] for request in replica.requests]


def saturated_gateway(replicas, start_gateway, **queue):
    a, _ = replicas
    config = gateway_config({"tiny": model_config(a, capacity=1)}, [dict(key) for key in KEYS])
    if queue:
        config["queue"] = queue
    gateway = start_gateway(config)
    a.hold()
    return a, gateway


def test_higher_tiers_are_served_first_fcfs_within_a_tier(replicas, start_gateway):
    a, gateway = saturated_gateway(replicas, start_gateway)
    queue = gateway.dispatcher.queue
    arrivals = [
        ("sk-low", "low-1", {}),
        ("sk-high", "high-1", {}),
        ("sk-low", "low-2", {}),
        ("sk-flex", "flex-raised", {"x_ember_priority": "3"}),  # within its max_priority
        ("sk-high", "high-lowered", {"x_ember_priority": "0"}),  # a key may always lower itself
        ("sk-flex", "flex-capped", {"x_ember_priority": "9"}),  # capped at max_priority 3
        ("sk-high", "high-2", {}),
    ]
    with concurrent.futures.ThreadPoolExecutor(len(arrivals) + 1) as pool:
        futures = [pool.submit(chat, gateway, "sk-low", "occupant")]
        wait_until(lambda: a.in_flight == 1, what="the occupant at the replica")
        for position, (key, tag, headers) in enumerate(arrivals, start=1):
            futures.append(pool.submit(chat, gateway, key, tag, **headers))
            wait_until(lambda position=position: queue.depth("tiny") == position, what=f"{tag} queued")
        assert gateway.metric("ember_gateway_queue_depth", model="tiny") == len(arrivals)
        a.release()
        assert [future.result().status_code for future in futures] == [200] * (len(arrivals) + 1)
    assert tags(a) == [
        "occupant", "flex-raised", "flex-capped", "high-1", "high-2", "low-1", "low-2", "high-lowered",
    ]  # fmt: skip
    assert a.max_in_flight == 1
    assert gateway.metric("ember_gateway_queue_wait_seconds_count", model="tiny") == len(arrivals)


def test_deadline_passes_in_the_queue_408(replicas, start_gateway):
    a, gateway = saturated_gateway(replicas, start_gateway)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        occupant = pool.submit(chat, gateway, "sk-low", "occupant")
        wait_until(lambda: a.in_flight == 1, what="the occupant at the replica")
        late = chat(gateway, "sk-high", "late", x_ember_deadline_ms="100")
        assert late.status_code == 408
        error = late.json()["error"]
        assert error["code"] == "deadline_exceeded" and error["type"] == "timeout_error"
        assert chat(gateway, "sk-patient", "key-default").status_code == 408  # the key's 150 ms default
        assert gateway.dispatcher.queue.depth("tiny") == 0
        a.release()
        assert occupant.result().status_code == 200
    assert tags(a) == ["occupant"]


def test_full_queue_429(replicas, start_gateway):
    a, gateway = saturated_gateway(replicas, start_gateway, max_size=1)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        occupant = pool.submit(chat, gateway, "sk-low", "occupant")
        wait_until(lambda: a.in_flight == 1, what="the occupant at the replica")
        waiting = pool.submit(chat, gateway, "sk-low", "waiting")
        wait_until(lambda: gateway.dispatcher.queue.depth("tiny") == 1, what="one queued")
        full = chat(gateway, "sk-high", "refused")
        assert full.status_code == 429
        assert full.json()["error"]["code"] == "queue_full" and full.headers["retry-after"] == "1"
        a.release()
        assert occupant.result().status_code == waiting.result().status_code == 200
    assert tags(a) == ["occupant", "waiting"]


def test_a_client_that_disconnects_leaves_the_queue_at_once(replicas, start_gateway):
    a, gateway = saturated_gateway(replicas, start_gateway)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        occupant = pool.submit(chat, gateway, "sk-low", "occupant")
        wait_until(lambda: a.in_flight == 1, what="the occupant at the replica")
        impatient = pool.submit(chat, gateway, "sk-high", "impatient", timeout=0.5)
        wait_until(lambda: gateway.dispatcher.queue.depth("tiny") == 1, what="queued")
        # The client gives up (read timeout closes its connection): the gateway drops the waiter.
        assert isinstance(impatient.exception(), httpx.ReadTimeout)
        wait_until(lambda: gateway.dispatcher.queue.depth("tiny") == 0, what="the waiter to leave")
        a.release()
        assert occupant.result().status_code == 200
    assert chat(gateway, "sk-low", "after").status_code == 200
    assert tags(a) == ["occupant", "after"]
    assert gateway.metric("ember_gateway_requests_total", model="tiny", key="high", replica="", status="cancelled") == 1


async def test_a_slot_a_failover_waiter_cannot_use_goes_to_the_next_in_line():
    """Replica a is free but the first waiter's failover excludes it; b is busy. A later request
    must get a at once instead of waiting behind it for b."""
    def replica(name: str) -> Replica:
        return Replica(name, f"http://{name}", "tiny", "tiny", "main", None, 1.0, None, {}, capacity=1)

    a, b = replica("a"), replica("b")
    pool = ReplicaPool([a, b])
    queue = AdmissionQueue(pool, max_size=8, metrics=GatewayMetrics())
    deadline = time.monotonic() + 30

    def free(exclude: set[str]):
        return lambda: next((r for r in (a, b) if r.has_capacity and r.id not in exclude), None)

    assert await queue.acquire("tiny", 0, deadline, free(set())) is a
    assert await queue.acquire("tiny", 0, deadline, free(set())) is b
    pool.release(a)  # a is free again, no one waits yet
    retry = asyncio.create_task(queue.acquire("tiny", 5, deadline, free({"a"})))  # failover: not a
    await asyncio.sleep(0)
    assert queue.depth("tiny") == 1 and not retry.done()
    newcomer = await asyncio.wait_for(queue.acquire("tiny", 0, deadline, free(set())), 10)
    assert newcomer is a and not retry.done()
    pool.release(b)
    assert await asyncio.wait_for(retry, 10) is b
    assert queue.depth("tiny") == 0
