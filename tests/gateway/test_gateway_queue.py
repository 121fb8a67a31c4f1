"""Who waits: the per-model priority queue in front of saturated replicas."""

from __future__ import annotations

import concurrent.futures

import httpx
from gateway_harness import gateway_config, model_config, wait_until

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
