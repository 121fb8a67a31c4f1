"""Each replica-choosing policy over real Replica objects built from a real gateway config."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest
from gateway_harness import admitted_pool

from ember.gateway.config import GatewayConfigError, parse_config
from ember.gateway.request_context import RequestContext
from ember.gateway.router import Router
from ember.gateway.routing import POLICIES, validate_routing
from ember.gateway.routing.least_outstanding import LeastOutstandingPolicy
from ember.gateway.routing.load_aware import LoadAwarePolicy
from ember.gateway.routing.round_robin import RoundRobinPolicy
from ember.gateway.routing.session_affinity import SessionAffinityPolicy
from ember.gateway.scraper import parse_load_metrics


def make_pool(replica_count: int, capacity: int = 8, policy: str = "round-robin", options: dict | None = None):
    config = parse_config(
        {
            "models": {
                "tiny": {
                    "routing": {"policy": policy, "options": options or {}},
                    "deployments": [
                        {
                            "replicas": [
                                {"url": f"http://127.0.0.1:{9000 + i}", "id": f"r{i}", "capacity": capacity}
                                for i in range(replica_count)
                            ]
                        }
                    ],
                }
            }
        }
    )
    return config, admitted_pool(config)


def chat(text: str = "hello", session: str | None = None) -> RequestContext:
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}]}
    return RequestContext("tiny", "chat/completions", body, "key", 0, session_id=session)


def test_round_robin_visits_every_replica_in_turn():
    _, pool = make_pool(3)
    policy = RoundRobinPolicy()
    picks = [policy.choose(pool.replicas("tiny"), chat()).replica.id for _ in range(9)]
    assert picks == ["r0", "r1", "r2"] * 3
    assert policy.choose([], chat()) is None


def test_round_robin_through_the_router_skips_ejected_and_excluded_replicas():
    config, pool = make_pool(3)
    router = Router(config, pool, random.Random(0))
    pool.eject(pool.get("r1"), "test")
    picks = Counter(router.select("tiny", chat()).id for _ in range(100))
    assert picks == {"r0": 50, "r2": 50}
    assert {router.select("tiny", chat(), exclude={"r0"}).id for _ in range(10)} == {"r2"}
    ctx = chat()
    assert router.select("tiny", ctx, exclude={"r0", "r2"}) is None
    assert ctx.extra["route"].reason == "no-usable-replica"


def test_router_returns_none_when_every_replica_is_at_capacity():
    config, pool = make_pool(2, capacity=1)
    router = Router(config, pool, random.Random(0))
    first = router.select("tiny", chat())
    pool.acquire(first)
    second = router.select("tiny", chat())
    assert second is not None and second.id != first.id
    pool.acquire(second)
    ctx = chat()
    assert router.select("tiny", ctx) is None
    assert ctx.extra["route"].reason == "saturated"
    pool.release(first)
    assert router.select("tiny", chat()) is first


def test_power_of_two_choices_prefers_the_less_loaded_replica():
    _, pool = make_pool(2, capacity=100)
    r0, r1 = pool.replicas("tiny")
    r0.outstanding, r1.outstanding = 10, 3
    policy = LeastOutstandingPolicy(rng=random.Random(1))
    assert {policy.choose([r0, r1], chat()).replica.id for _ in range(50)} == {"r1"}


def test_power_of_two_choices_never_picks_the_most_loaded_of_many():
    _, pool = make_pool(5, capacity=100)
    replicas = pool.replicas("tiny")
    for load, replica in enumerate(replicas):
        replica.outstanding = load * 10  # r0 idle ... r4 busiest
    policy = LeastOutstandingPolicy(rng=random.Random(2))
    picks = Counter(policy.choose(replicas, chat()).replica.id for _ in range(2000))
    assert "r4" not in picks
    # r0 wins every pair it is drawn in (4 of the 10 pairs), r3 only the pair (r3, r4).
    assert picks["r0"] > picks["r1"] > picks["r2"] > picks["r3"] > 0
    assert abs(picks["r0"] / 2000 - 0.4) < 0.05


def test_power_of_two_choices_compares_relative_load_for_unequal_capacities():
    _, pool = make_pool(2)
    big, small = pool.replicas("tiny")
    big.capacity, small.capacity = 32, 4
    big.outstanding, small.outstanding = 8, 2  # 25% vs 50% utilized
    policy = LeastOutstandingPolicy(rng=random.Random(3))
    assert policy.choose([big, small], chat()).replica is big


EMBER_METRICS = """\
# HELP ember:num_requests_running Requests in the engine's running batch.
# TYPE ember:num_requests_running gauge
ember:num_requests_running{model_name="tiny"} 4.0
# HELP ember:num_requests_waiting Requests waiting for the engine to schedule them.
# TYPE ember:num_requests_waiting gauge
ember:num_requests_waiting{model_name="tiny"} 6.0
# HELP ember:kv_cache_usage_perc Fraction of KV-cache blocks in use (0..1).
# TYPE ember:kv_cache_usage_perc gauge
ember:kv_cache_usage_perc{model_name="tiny"} 0.75
# HELP ember:prefix_cache_hits_total Prompt tokens found in the prefix cache.
# TYPE ember:prefix_cache_hits_total counter
ember:prefix_cache_hits_total{model_name="tiny"} 320.0
# HELP ember:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.
# TYPE ember:prefix_cache_queries_total counter
ember:prefix_cache_queries_total{model_name="tiny"} 1000.0
# HELP ember:e2e_request_latency_seconds Histogram of end to end request latency in seconds.
# TYPE ember:e2e_request_latency_seconds histogram
ember:e2e_request_latency_seconds_bucket{le="0.3",model_name="tiny"} 3.0
ember:e2e_request_latency_seconds_bucket{le="+Inf",model_name="tiny"} 5.0
ember:e2e_request_latency_seconds_count{model_name="tiny"} 5.0
ember:e2e_request_latency_seconds_sum{model_name="tiny"} 2.5
"""

# vLLM v1's exposition: two engines (data parallel) report separately and must be added up.
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.1
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.2
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 500.0
vllm:prefix_cache_queries_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 300.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 200.0
vllm:prefix_cache_hits_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
"""

# An older vLLM (v0) names KV usage gpu_cache_usage_perc.
VLLM_V0_METRICS = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.05
"""


def test_parse_load_metrics_reads_ember_vllm_and_sglang_names():
    ember = parse_load_metrics(EMBER_METRICS)
    assert (ember.waiting, ember.running, ember.kv_usage) == (6.0, 4.0, 0.75)
    assert (ember.prefix_cache_hits, ember.prefix_cache_queries) == (320.0, 1000.0)
    vllm = parse_load_metrics(VLLM_METRICS)
    assert (vllm.waiting, vllm.running) == (1.0, 2.0)
    assert vllm.kv_usage == pytest.approx(0.2)  # the fullest engine decides
    assert (vllm.prefix_cache_hits, vllm.prefix_cache_queries) == (300.0, 800.0)
    old = parse_load_metrics(VLLM_V0_METRICS)
    assert (old.waiting, old.running, old.kv_usage, old.prefix_cache_hits) == (0.0, 0.0, 0.05, None)
    sglang = parse_load_metrics(
        '# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{model_name="m"} 5.0\n'
        '# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{model_name="m"} 2.0\n'
        '# TYPE sglang:token_usage gauge\nsglang:token_usage{model_name="m"} 0.4\n'
    )
    assert (sglang.waiting, sglang.running, sglang.kv_usage) == (2.0, 5.0, 0.4)
    empty = parse_load_metrics("# nothing a router can use\nhttp_requests_total 3\n")
    assert (empty.waiting, empty.running, empty.kv_usage) == (None, None, None)


def test_load_aware_orders_replicas_by_score_from_scraped_metrics():
    _, pool = make_pool(3, capacity=100, policy="load-aware")
    busy, vllm_replica, old_vllm = pool.replicas("tiny")
    now = time.monotonic()
    for replica, text in ((busy, EMBER_METRICS), (vllm_replica, VLLM_METRICS), (old_vllm, VLLM_V0_METRICS)):
        replica.metrics = parse_load_metrics(text)
        replica.metrics.scraped_at = now
    policy = LoadAwarePolicy()
    # busy: 6 + 0.25*4 + 4*0.75 = 10; vllm: 1 + 0.25*2 + 4*0.2 = 2.3; old vLLM: 4*0.05 = 0.2
    assert policy.choose([busy, vllm_replica, old_vllm], chat()).replica is old_vllm
    assert policy.choose([busy, vllm_replica], chat()).replica is vllm_replica
    # Requests the gateway sent since the last scrape count too: 3 in flight outweigh 2.3 - 0.2.
    old_vllm.outstanding = 3
    assert policy.choose([busy, vllm_replica, old_vllm], chat()).replica is vllm_replica
    # A stale snapshot is ignored, leaving only the live count.
    busy.metrics.scraped_at = now - 60
    assert policy.choose([busy, vllm_replica, old_vllm], chat()).replica is busy


def test_load_aware_weights_come_from_routing_options():
    config, pool = make_pool(2, capacity=100, policy="load-aware", options={"kv_usage_weight": 0, "running_weight": 5})
    router = Router(config, pool, random.Random(0))
    r0, r1 = pool.replicas("tiny")
    now = time.monotonic()
    r0.metrics = parse_load_metrics(EMBER_METRICS)  # running 4, KV 0.75
    r1.metrics = parse_load_metrics(VLLM_METRICS)  # running 2, waiting 1
    r0.metrics.scraped_at = r1.metrics.scraped_at = now
    assert router.select("tiny", chat()) is r1


@pytest.mark.parametrize("check", ["router", "validate_routing"])
def test_bad_routing_options_fail_at_start_with_the_field_path(check: str):
    """The router refuses them, and validate_routing (what `ember up` runs) says the same without one."""
    config, pool = make_pool(2, policy="prefix-cache", options={"block_chars": 0, "colour": "red"})
    with pytest.raises(GatewayConfigError) as info:
        Router(config, pool) if check == "router" else validate_routing(config)
    message = str(info.value)
    assert message.startswith("models.tiny.routing.options: ")
    assert "block_chars: Input should be greater than or equal to 1" in message
    assert "colour: Extra inputs are not permitted" in message


def test_validate_routing_accepts_every_policy_with_its_own_options():
    options = {
        "round-robin": {},
        "least-outstanding": {},
        "session-affinity": {},
        "load-aware": {"kv_usage_weight": 0, "running_weight": 5},
        "prefix-cache": {"block_chars": 16, "cache_threshold": 0.5},
    }
    assert set(options) == set(POLICIES)
    for policy, policy_options in options.items():
        config, _ = make_pool(1, policy=policy, options=policy_options)
        assert validate_routing(config) is None


def test_session_affinity_is_stable_and_moves_only_the_sessions_of_a_leaving_replica():
    config, pool = make_pool(4, capacity=1000, policy="session-affinity")
    router = Router(config, pool, random.Random(0))
    sessions = [f"user-{i}" for i in range(400)]
    before = {s: router.select("tiny", chat(session=s)).id for s in sessions}
    assert before == {s: router.select("tiny", chat(session=s)).id for s in sessions}
    spread = Counter(before.values())
    assert set(spread) == {"r0", "r1", "r2", "r3"} and min(spread.values()) > 60
    # A second router (another gateway instance, another process seed) agrees.
    other = Router(config, admitted_pool(config), random.Random(99))
    assert before == {s: other.select("tiny", chat(session=s)).id for s in sessions}

    pool.eject(pool.get("r2"), "test")
    after = {s: router.select("tiny", chat(session=s)).id for s in sessions}
    moved = {s for s in sessions if after[s] != before[s]}
    assert moved == {s for s in sessions if before[s] == "r2"}
    assert "r2" not in after.values()

    pool.readmit(pool.get("r2"))
    assert before == {s: router.select("tiny", chat(session=s)).id for s in sessions}


def test_session_affinity_without_a_session_uses_the_least_utilized_replica():
    _, pool = make_pool(2, capacity=10)
    r0, r1 = pool.replicas("tiny")
    r0.outstanding = 5
    choice = SessionAffinityPolicy(rng=random.Random(0)).choose([r0, r1], chat())
    assert choice.replica is r1 and choice.reason == "no-session"
