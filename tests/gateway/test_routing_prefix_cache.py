"""Prefix-cache-aware routing: same-prefix prompts stick to one replica, bounded by load."""

from __future__ import annotations

import random

from gateway_harness import admitted_pool
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.gateway.config import parse_config
from ember.gateway.request_context import RequestContext
from ember.gateway.router import Router
from ember.gateway.routing.prefix_cache import PrefixCachePolicy, PrefixIndex

SYSTEM = "You are a meticulous assistant for the Ember inference platform. Answer in one sentence. " * 3


def make_router(replica_count: int = 3, **options):
    config = parse_config(
        {
            "models": {
                "tiny": {
                    "routing": {"policy": "prefix-cache", "options": options},
                    "deployments": [
                        {
                            "replicas": [
                                {"url": f"http://127.0.0.1:{9100 + i}", "id": f"r{i}", "capacity": 64}
                                for i in range(replica_count)
                            ]
                        }
                    ],
                }
            }
        }
    )
    pool = admitted_pool(config)
    return Router(config, pool, random.Random(0)), pool


def chat(system: str, question: str) -> RequestContext:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    return RequestContext("tiny", "chat/completions", body, "key", 0)


def route(router: Router, ctx: RequestContext):
    replica = router.select("tiny", ctx)
    return replica.id, ctx.extra["route"].reason


def test_block_hashes_chain_so_only_a_shared_leading_run_matches():
    index = PrefixIndex(block_chars=4, max_blocks_per_replica=100)
    a = index.block_hashes("abcdefghijkl")
    b = index.block_hashes("abcdefghXXXX")
    c = index.block_hashes("XXXXefghijkl")  # same later blocks, different start: nothing shared
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert not set(a) & set(c)
    assert index.block_hashes("abc") == []
    index.insert(a, "r0")
    index.insert(b[:1], "r1")
    assert index.match(b, ["r0", "r1", "r2"]) == {"r0": 2, "r1": 1, "r2": 0}
    assert index.match(c, ["r0", "r1"]) == {"r0": 0, "r1": 0}


def test_same_prefix_prompts_land_on_the_same_replica_and_new_prefixes_spread():
    router, _ = make_router()
    first, reason = route(router, chat(SYSTEM, "What is a KV cache?"))
    assert reason == "cache-miss"
    for question in ("Define prefill.", "What is speculative decoding?", "Why batch requests?"):
        assert route(router, chat(SYSTEM, question)) == (first, "cache-hit")
    # Two unrelated system prompts go where nothing is cached yet: the two other replicas.
    other_a, _ = route(router, chat("Translate everything into French, politely and briefly. " * 3, "Hi"))
    other_b, _ = route(router, chat("You write haiku about databases and nothing else at all. " * 3, "Go"))
    assert {first, other_a, other_b} == {"r0", "r1", "r2"}
    assert route(router, chat("Translate everything into French, politely and briefly. " * 3, "Bye")) == (
        other_a,
        "cache-hit",
    )


def test_an_overloaded_cache_holder_is_bypassed_for_the_least_loaded_replica():
    router, pool = make_router(balance_abs_threshold=4, balance_rel_threshold=1.5)
    holder, _ = route(router, chat(SYSTEM, "warm up"))
    holder_replica = pool.get(holder)
    second, third = (replica for replica in pool.replicas("tiny") if replica is not holder_replica)
    second.outstanding, third.outstanding = 3, 2
    holder_replica.outstanding = 6  # 6 - 2 = 4: not beyond the absolute bound, the cache wins
    assert route(router, chat(SYSTEM, "q1")) == (holder, "cache-hit")
    holder_replica.outstanding = 7  # 7 - 2 > 4 and 7 > 1.5 * 2: too far above the least loaded
    assert route(router, chat(SYSTEM, "q2")) == (third.id, "balance")
    # The replica it was balanced to now holds the prefix too and wins it while the holder is busy.
    third.outstanding = 3
    assert route(router, chat(SYSTEM, "q3")) == (third.id, "cache-hit")


def test_low_overlap_counts_as_a_miss_and_short_prompts_go_by_load():
    router, pool = make_router(cache_threshold=0.5)
    holder, _ = route(router, chat("Shared opening line for everyone. ", "x" * 10))
    # Only the first ~2 of 20 blocks are shared: below half, so treated as a new prefix.
    long_tail = "A completely different and much longer question that dominates the prompt. " * 4
    assert route(router, chat("Shared opening line for everyone. ", long_tail)) != (holder, "cache-hit")
    r0, r1, r2 = pool.replicas("tiny")
    r0.outstanding, r1.outstanding, r2.outstanding = 2, 0, 1
    short = RequestContext("tiny", "completions", {"prompt": "hi"}, "key", 0)
    assert route(router, short) == ("r1", "no-prefix")


def test_malformed_messages_are_routed_by_load_for_the_replica_to_refuse():
    # `"messages": true` was a TypeError (a 500) in the routing's prompt text; found by fuzzing.
    router, pool = make_router()
    r0, r1, r2 = pool.replicas("tiny")
    r0.outstanding, r1.outstanding, r2.outstanding = 2, 1, 0
    for messages in (True, 5, {"role": "user"}, "text"):
        ctx = RequestContext("tiny", "chat/completions", {"messages": messages}, "key", 0)
        assert ctx.prompt_text == "" and route(router, ctx) == ("r2", "no-prefix")


def test_token_id_prompts_are_routed_by_their_shared_token_prefix():
    router, _ = make_router()
    shared = list(range(1000, 1060))

    def tokens(tail: list[int]) -> RequestContext:
        return RequestContext("tiny", "completions", {"prompt": shared + tail}, "key", 0)

    holder, reason = route(router, tokens([7, 8, 9]))
    assert reason == "cache-miss"
    assert route(router, tokens([4, 5])) == (holder, "cache-hit")
    batched = RequestContext("tiny", "completions", {"prompt": [shared + [1], shared + [2]]}, "key", 0)
    assert route(router, batched) == (holder, "cache-hit")


def test_lru_eviction_bounds_each_replica_and_forgets_the_oldest_prefixes():
    policy = PrefixCachePolicy({"block_chars": 8, "max_blocks_per_replica": 40}, random.Random(0))
    index = policy.index
    old = index.block_hashes("old prompt that was sent long ago. " * 4)
    index.insert(old, "r0")
    assert index.match(old, ["r0"]) == {"r0": len(old)}
    for i in range(10):
        index.insert(index.block_hashes(f"newer prompt number {i} with some text " * 2), "r0")
    assert index.size("r0") == 40
    # The old chain was evicted from its tail first: what is left of it is still a leading run.
    assert index.match(old, ["r0"])["r0"] < len(old)
    policy.forget("r0")
    assert index.size("r0") == 0 and index.match(old, ["r0"]) == {"r0": 0}


def test_ejecting_a_replica_forgets_its_prefixes():
    router, pool = make_router(replica_count=2)
    holder, _ = route(router, chat(SYSTEM, "q"))
    other, _ = route(router, chat("An unrelated system prompt that only the other replica sees. " * 2, "q"))
    assert other != holder
    pool.eject(pool.get(holder), "test")
    pool.readmit(pool.get(holder))
    # The holder restarted with an empty cache: the prefix is new again and goes to the replica
    # tracking fewer blocks, which is now the restarted one (it tracks none).
    assert route(router, chat(SYSTEM, "q again")) == (holder, "cache-miss")
    assert route(router, chat(SYSTEM, "and again")) == (holder, "cache-hit")


@settings(max_examples=200, deadline=None)
@given(
    prompts=st.lists(st.text(alphabet="ab", min_size=0, max_size=40), min_size=1, max_size=30),
    capacity=st.integers(min_value=1, max_value=12),
)
def test_binary_search_match_equals_a_linear_scan_under_any_insert_and_evict_sequence(prompts, capacity):
    """The index's invariant (a held block implies its whole chain before it is held, even after LRU
    evictions) is what lets `match` binary-search; check it against the plain definition."""
    index = PrefixIndex(block_chars=4, max_blocks_per_replica=capacity)
    for prompt in prompts:
        index.insert(index.block_hashes(prompt), "r0")
    held = index._lru["r0"]
    for prompt in prompts:
        hashes = index.block_hashes(prompt)
        linear = 0
        while linear < len(hashes) and hashes[linear] in held:
            linear += 1
        assert index.match(hashes, ["r0"]) == {"r0": linear}
        assert all(block not in held for block in hashes[linear:])  # nothing held past the first miss
