"""Version canaries by traffic weight and region-aware selection with spill-over, through the Router."""

from __future__ import annotations

import random
from collections import Counter

from gateway_harness import admitted_pool

from ember.gateway.config import parse_config
from ember.gateway.request_context import RequestContext
from ember.gateway.router import Router
from ember.gateway.routing.canary import CanarySplitter


def ctx(session: str | None = None, region: str | None = None) -> RequestContext:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    return RequestContext("tiny", "chat/completions", body, "key", 0, client_region=region, session_id=session)


def canary_router(seed: int = 7):
    config = parse_config(
        {
            "models": {
                "tiny": {
                    "routing": {"policy": "round-robin"},
                    "deployments": [
                        {"name": "stable", "version": "v1", "weight": 90, "replicas": [
                            {"url": "http://127.0.0.1:9201", "id": "stable-a"},
                            {"url": "http://127.0.0.1:9202", "id": "stable-b"},
                        ]},
                        {"name": "canary", "version": "v2", "weight": 10, "replicas": [
                            {"url": "http://127.0.0.1:9203", "id": "canary-a"},
                        ]},
                        {"name": "dark", "version": "v3", "weight": 0, "replicas": [
                            {"url": "http://127.0.0.1:9204", "id": "dark-a"},
                        ]},
                    ],
                }
            }
        }
    )  # fmt: skip
    pool = admitted_pool(config)
    return Router(config, pool, random.Random(seed)), pool


def test_canary_weights_hold_within_tolerance_over_2000_picks():
    router, _ = canary_router()
    picks = Counter(router.select("tiny", ctx()).id for _ in range(2000))
    canary_share = picks["canary-a"] / 2000
    assert abs(canary_share - 0.10) < 0.02, picks
    assert abs(picks["stable-a"] - picks["stable-b"]) <= 1  # round robin inside the deployment
    assert "dark-a" not in picks  # weight 0: no traffic at all


def test_canary_is_deterministic_per_session_and_splits_sessions_by_weight():
    router, _ = canary_router()
    sessions = [f"session-{i}" for i in range(2000)]
    first = {s: router.select("tiny", ctx(session=s)).deployment for s in sessions}
    assert first == {s: router.select("tiny", ctx(session=s)).deployment for s in sessions}
    other_process, _ = canary_router(seed=12345)
    assert first == {s: other_process.select("tiny", ctx(session=s)).deployment for s in sessions}
    assert abs(Counter(first.values())["canary"] / 2000 - 0.10) < 0.02
    decision = ctx(session="session-1")
    router.select("tiny", decision)
    assert decision.extra["route"].deployment_reason == "session"


def test_canary_outage_sends_its_traffic_to_the_other_deployments():
    router, pool = canary_router()
    pool.eject(pool.get("canary-a"), "test")
    picks = Counter(router.select("tiny", ctx()).deployment for _ in range(300))
    assert picks == {"stable": 300}
    # A failover retry that already tried every stable replica still never lands on weight 0.
    assert router.select("tiny", ctx(), exclude={"stable-a", "stable-b"}) is None


def test_canary_splitter_draws_with_a_fixed_seed():
    splitter = CanarySplitter(random.Random(3))
    picks = Counter(splitter.pick({"a": 1, "b": 3}, None)[0] for _ in range(2000))
    assert abs(picks["b"] / 2000 - 0.75) < 0.03
    assert splitter.pick({"a": 0}, None) is None
    assert splitter.pick({"a": 0, "b": 2}, "s") == ("b", "only-deployment")


def region_router(capacity: int = 2):
    def replicas(region: str, count: int) -> list[dict]:
        return [
            {"url": f"http://{region}-{i}.internal:8000", "id": f"{region}-{i}", "region": region, "capacity": capacity}
            for i in range(count)
        ]

    config = parse_config(
        {
            "listener_region": "us-east",
            "regions": {
                "us-east": {"latency_ms": {"us-west": 70, "eu-west": 90}},
                "us-west": {"latency_ms": {"eu-west": 150}},
                "eu-west": {},
                "ap-south": {},  # no latency declared to anyone: farthest, last resort
            },
            "models": {
                "tiny": {
                    "routing": {"policy": "least-outstanding"},
                    "deployments": [
                        {"replicas": replicas("us-east", 2) + replicas("us-west", 1) + replicas("eu-west", 2)}
                    ],
                }
            },
        }
    )
    pool = admitted_pool(config)
    return Router(config, pool, random.Random(0)), pool


def routed(router: Router, region: str | None, exclude: frozenset[str] = frozenset()):
    request = ctx(region=region)
    replica = router.select("tiny", request, exclude)
    decision = request.extra["route"]
    return (replica.region if replica else None), decision.region_reason


def test_each_region_is_served_locally_and_a_region_without_replicas_by_the_nearest():
    router, _ = region_router()
    for region in ("us-east", "us-west", "eu-west"):
        assert {routed(router, region) for _ in range(20)} == {(region, "local")}
    # ap-south declares no latency to anyone: every region is equally far, ties go by name.
    assert routed(router, "ap-south") == ("eu-west", "nearest")


def test_an_undeclared_region_header_gets_no_preference():
    router, _ = region_router()
    regions = Counter(routed(router, "mars-1") for _ in range(200))
    assert {reason for _, reason in regions} == {"any-region"}
    assert {region for region, _ in regions} == {"us-east", "us-west", "eu-west"}


def test_spill_over_on_outage_goes_to_the_next_nearest_region():
    router, pool = region_router()
    for replica in pool.replicas("tiny"):
        if replica.region == "us-east":
            pool.eject(replica, "test")
    # us-east clients: us-west (70 ms) before eu-west (90 ms).
    assert routed(router, "us-east") == ("us-west", "spill-outage")
    pool.eject(pool.get("us-west-0"), "test")
    assert routed(router, "us-east") == ("eu-west", "spill-outage")
    # us-west clients lost their only replica: us-east is nearer (70) but down, so eu-west (150).
    assert routed(router, "us-west") == ("eu-west", "spill-outage")
    # Failover retries exclude replicas they tried: the same spill logic applies.
    retry = ctx(region="eu-west")
    assert router.select("tiny", retry, frozenset({"eu-west-0", "eu-west-1"})) is None
    assert retry.extra["route"].reason == "no-usable-replica"
    pool.readmit(pool.get("us-east-1"))
    assert routed(router, "us-east") == ("us-east", "local")


def test_spill_over_on_saturation_and_back_when_capacity_frees():
    router, pool = region_router(capacity=2)
    east = [replica for replica in pool.replicas("tiny") if replica.region == "us-east"]
    held = []
    for _ in range(4):  # fill both us-east replicas (2 slots each)
        request = ctx(region="us-east")
        replica = router.select("tiny", request)
        assert replica.region == "us-east"
        pool.acquire(replica)
        held.append(replica)
    assert all(replica.outstanding == 2 for replica in east)
    assert routed(router, "us-east") == ("us-west", "spill-overload")
    pool.acquire(pool.get("us-west-0"))
    pool.acquire(pool.get("us-west-0"))
    assert routed(router, "us-east") == ("eu-west", "spill-overload")
    for replica in pool.replicas("tiny"):
        replica.outstanding = replica.capacity
    assert routed(router, "us-east") == (None, "saturated")
    pool.release(held[0])
    assert routed(router, "us-east") == ("us-east", "local")


def test_region_awareness_can_be_switched_off_per_model():
    config = parse_config(
        {
            "regions": {"a": {"latency_ms": {"b": 10}}, "b": {}},
            "models": {
                "tiny": {
                    "routing": {"policy": "round-robin", "region_aware": False},
                    "deployments": [{"replicas": [
                        {"url": "http://a:1", "id": "a", "region": "a"},
                        {"url": "http://b:1", "id": "b", "region": "b"},
                    ]}],
                }
            },
        }
    )  # fmt: skip
    router = Router(config, admitted_pool(config), random.Random(0))
    assert Counter(router.select("tiny", ctx(region="a")).id for _ in range(10)) == {"a": 5, "b": 5}
