"""A front door (`clusters:` in the gateway file) over two cluster gateways in two regions, each with its
own replica: the nearest ready cluster serves, a cluster whose `/ready` fails is ejected and its traffic
moves to the other, it is re-admitted when ready again, a cluster at capacity spills over, and the
front door authenticates the client once and sends each cluster its own service credential."""

from __future__ import annotations

import concurrent.futures

import httpx
import orjson
import pytest
from gateway_harness import FakeReplica, gateway_config, http, model_config, wait_until

from ember.gateway.config import GatewayConfigError, parse_config
from ember.gateway.scraper import parse_load_metrics

CLIENT_KEY = "sk-client"


def chat(front_door, key: str = CLIENT_KEY) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return http.post(
        front_door.url + "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )


def served_by(response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["system_fingerprint"]  # the fake replica's name


def test_front_door_prefers_the_nearest_ready_cluster_and_fails_over(start_gateway):
    east_replica, west_replica = FakeReplica("east-replica").start(), FakeReplica("west-replica").start()
    try:
        # Each cluster gateway knows only its own service credential, never the client's key.
        east = start_gateway(
            gateway_config(
                {"tiny": model_config(east_replica)}, [{"name": "front", "secret": "sk-east-service"}]
            )
        )
        west = start_gateway(
            gateway_config(
                {"tiny": model_config(west_replica)}, [{"name": "front", "secret": "sk-west-service"}]
            )
        )
        clusters = {
            "models": ["tiny"],
            "members": {
                "east": {"url": east.url, "region": "us-east", "capacity": 1, "api_key": "sk-east-service"},
                "west": {"url": west.url, "region": "us-west", "capacity": 4, "api_key": "sk-west-service"},
            },
        }
        config = gateway_config(
            {}, [{"name": "client", "secret": CLIENT_KEY, "rpm": 1000}], clusters=clusters
        )
        del config["models"]
        config.update(
            listener_region="us-east", regions={"us-east": {"latency_ms": {"us-west": 70}}, "us-west": {}}
        )
        front_door = start_gateway(config)
        # Both clusters are probed concurrently: on a busy machine west can be admitted first and serve alone.
        wait_until(lambda: served_by(chat(front_door)) == "east-replica", what="the front door to admit east")

        assert [served_by(chat(front_door)) for _ in range(3)] == ["east-replica"] * 3  # nearest region
        assert chat(front_door, "sk-wrong").status_code == 401  # authenticated once, at the front door
        assert (
            http.post(
                east.url + "/v1/chat/completions", json={}, headers={"authorization": f"Bearer {CLIENT_KEY}"}
            ).status_code
            == 401
        )

        # Spill-over: east (capacity 1) is busy with a held request, the next one goes west.
        east_replica.hold()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(chat, front_door)
            wait_until(lambda: east_replica.in_flight == 1, what="a request held in east")
            assert served_by(chat(front_door)) == "west-replica"
            east_replica.release()
            assert served_by(held.result()) == "east-replica"

        # Outage: east's replica fails its health checks, so east's /ready fails and the front door ejects it.
        east_replica.health_status = 503
        wait_until(lambda: http.get(east.url + "/ready").status_code == 503, what="east not ready")
        wait_until(lambda: served_by(chat(front_door)) == "west-replica", what="traffic moved to west")
        assert all(chat(front_door).status_code == 200 for _ in range(5))
        # Recovery: east ready again is probed back and preferred again.
        east_replica.health_status = 200
        wait_until(lambda: served_by(chat(front_door)) == "east-replica", what="east re-admitted")
        # Usage is counted at the front door against the client's key: once per request a replica served.
        usage = http.get(
            front_door.url + "/v1/usage", headers={"authorization": f"Bearer {CLIENT_KEY}"}
        ).json()
        assert usage["key"] == "client"
        assert usage["requests"] == len(east_replica.requests) + len(west_replica.requests)
        assert usage["total_tokens"] == 10 * usage["requests"]  # the fake replicas report 10 tokens each
    finally:
        east_replica.stop()
        west_replica.stop()


def test_clusters_replace_models_and_are_validated():
    member = {"url": "http://10.0.0.1:8080", "region": "us-east", "api_key": "sk-service"}
    config = parse_config({"clusters": {"models": ["tiny", "big"], "members": {"east": member}}})
    assert sorted(config.models) == ["big", "tiny"]
    assert [r.replica_id for r in config.models["big"].deployments[0].replicas] == ["east/big"]
    assert config.health.path == "/ready"
    both = {
        "models": {"tiny": {"deployments": []}},
        "clusters": {"models": ["tiny"], "members": {"east": member}},
    }
    with pytest.raises(
        GatewayConfigError, match="a front door \\(clusters\\) serves clusters.models; leave models out"
    ):
        parse_config(both)
    with pytest.raises(GatewayConfigError, match="members"):
        parse_config({"clusters": {"models": ["tiny"], "members": {}}})


def test_a_stream_cut_inside_a_cluster_ends_at_the_client_with_an_error_then_done(start_gateway):
    replica = FakeReplica("fragile").start()
    try:
        replica.die_after_chunks = 1
        cluster = start_gateway(
            gateway_config({"tiny": model_config(replica)}, [{"name": "front", "secret": "sk-service"}])
        )
        member = {"url": cluster.url, "region": "us-east", "api_key": "sk-service"}
        config = gateway_config(
            {},
            [{"name": "client", "secret": CLIENT_KEY}],
            clusters={"models": ["tiny"], "members": {"east": member}},
        )
        del config["models"]
        front_door = start_gateway(config)
        wait_until(lambda: chat(front_door).status_code == 200, what="the front door to admit its cluster")
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "stream": True,
        }
        response = http.post(
            front_door.url + "/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {CLIENT_KEY}"},
            timeout=30,
        )
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
        assert len(events) == 3
        assert orjson.loads(events[0])["choices"][0]["delta"]["content"] == "Hello"
        error = orjson.loads(events[1])["error"]
        assert error["type"] == "server_error" and error["code"] == "upstream_stream_error"
        assert events[2] == "[DONE]"
    finally:
        replica.stop()


CLUSTER_METRICS = """\
ember_gateway_queue_depth{model="tiny"} 3.0
ember_gateway_queue_depth{model="big"} 9.0
ember_gateway_replica_healthy{deployment="main",model="tiny",region="",replica="a"} 1.0
ember_gateway_replica_healthy{deployment="main",model="tiny",region="",replica="b"} 0.0
ember_gateway_replica_healthy{deployment="main",model="big",region="",replica="c"} 1.0
ember_gateway_replica_outstanding{deployment="main",model="tiny",region="",replica="a"} 4.0
ember_gateway_replica_outstanding{deployment="main",model="big",region="",replica="c"} 7.0
ember_gateway_replica_capacity{deployment="main",model="tiny",region="",replica="a"} 4.0
ember_gateway_replica_capacity{deployment="main",model="tiny",region="",replica="b"} 8.0
ember_gateway_replica_capacity{deployment="main",model="big",region="",replica="c"} 16.0
"""


def test_a_cluster_gateways_metrics_are_its_load_for_one_model():
    tiny = parse_load_metrics(CLUSTER_METRICS, "tiny")
    assert (tiny.waiting, tiny.running, tiny.capacity) == (3.0, 4.0, 4.0)  # b is ejected: not capacity
    big = parse_load_metrics(CLUSTER_METRICS, "big")
    assert (big.waiting, big.running, big.capacity) == (9.0, 7.0, 16.0)
    assert parse_load_metrics("vllm:num_requests_running 2\n", "tiny").capacity is None


def test_a_cluster_whose_queue_builds_is_spilled_from_before_its_capacity_is_reached(start_gateway):
    east_replica, west_replica = FakeReplica("east-replica").start(), FakeReplica("west-replica").start()
    try:
        east = start_gateway(
            gateway_config(
                {"tiny": model_config(east_replica, capacity=1)},
                [{"name": "front", "secret": "sk-east-service"}],
            )
        )
        west = start_gateway(
            gateway_config(
                {"tiny": model_config(west_replica)}, [{"name": "front", "secret": "sk-west-service"}]
            )
        )
        clusters = {
            "models": ["tiny"],
            "members": {
                "east": {"url": east.url, "region": "us-east", "capacity": 64, "api_key": "sk-east-service"},
                "west": {"url": west.url, "region": "us-west", "capacity": 64, "api_key": "sk-west-service"},
            },
        }
        config = gateway_config({}, [{"name": "client", "secret": CLIENT_KEY}], clusters=clusters)
        del config["models"]
        config.update(
            listener_region="us-east",
            regions={"us-east": {"latency_ms": {"us-west": 70}}, "us-west": {}},
            scrape={"interval_s": 0.05},
        )
        front_door = start_gateway(config)
        wait_until(lambda: chat(front_door).status_code == 200, what="the front door to admit its clusters")
        # Back to back, one at a time: east, every time (the last scrape's running request was ours).
        assert [served_by(chat(front_door)) for _ in range(5)] == ["east-replica"] * 5

        # Other clients fill east's one replica slot and its queue, directly: the front door has nothing
        # in flight there (0 of its 64), only east's /metrics shows the load.
        east_replica.hold()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            direct = [pool.submit(chat, east, "sk-east-service") for _ in range(2)]
            wait_until(
                lambda: east.metric("ember_gateway_queue_depth", model="tiny") == 1, what="east's queue"
            )
            east_at_front_door = front_door.dispatcher.pool.get("east/tiny")
            wait_until(
                lambda: east_at_front_door.metrics.waiting == 1, what="the front door's scrape of east"
            )
            assert east_at_front_door.outstanding == 0
            assert [served_by(chat(front_door)) for _ in range(3)] == ["west-replica"] * 3
            east_replica.release()
            assert [response.result().status_code for response in direct] == [200, 200]
        wait_until(lambda: served_by(chat(front_door)) == "east-replica", what="east preferred again")
    finally:
        east_replica.stop()
        west_replica.stop()
