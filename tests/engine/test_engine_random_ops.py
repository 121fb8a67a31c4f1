"""Randomized add/abort/step sequences on a real engine with a tiny KV cache: block invariants hold
after every operation and every block is free once all requests are done."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 10
PREFIXES = [[], [11, 12, 13, 14, 15, 16, 17, 18], [11, 12, 13, 14, 99, 98, 97, 96, 95]]

add_op = st.tuples(
    st.just("add"),
    st.sampled_from(range(len(PREFIXES))),
    st.integers(1, 20),  # suffix length
    st.integers(1, 12),  # max_tokens
    st.integers(1, 3),  # n
    st.integers(-1, 2),  # priority
    st.booleans(),  # greedy
)
abort_op = st.tuples(st.just("abort"), st.integers(0, 40))
step_op = st.tuples(st.just("step"), st.integers(1, 4))
operations = st.lists(st.one_of(add_op, abort_op, step_op), min_size=1, max_size=30)


@pytest.fixture(scope="module")
def small_engine(make_llm):
    # Block bytes: 2 * 2 layers * 2 kv heads * 4 tokens * 16 dims * 4 bytes.
    gib = NUM_BLOCKS * (2 * 2 * 2 * BLOCK_SIZE * 16 * 4) / (1 << 30)
    engine = make_llm(block_size=BLOCK_SIZE, kv_cache_memory=gib, max_num_seqs=4,
                      max_num_batched_tokens=12).engine
    assert engine.block_manager.num_blocks == NUM_BLOCKS
    return engine


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=operations)
def test_random_add_abort_step_keeps_blocks_consistent(small_engine, ops):
    engine = small_engine
    added: list[str] = []
    for op in ops:
        if op[0] == "add":
            _, prefix, suffix_len, max_tokens, n, priority, greedy = op
            request_id = f"q{len(added)}"
            prompt = PREFIXES[prefix] + [(7 * len(added) + i) % 500 + 3 for i in range(suffix_len)]
            params = SamplingParams(temperature=0 if greedy else 1.0, seed=len(added), n=n,
                                    max_tokens=max_tokens, ignore_eos=True)
            engine.add_request(request_id, prompt, params, priority=priority)
            added.append(request_id)
        elif op[0] == "abort" and added:
            engine.abort_request(added[op[1] % len(added)])
        else:
            for _ in range(op[1]):
                engine.step()
                engine.check_invariants()
        engine.check_invariants()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
        steps += 1
        assert steps < 2000, "the engine stopped making progress"
    stats = engine.stats()
    assert stats.num_free_blocks == NUM_BLOCKS and stats.num_running == stats.num_waiting == 0
