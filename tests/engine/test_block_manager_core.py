"""Block manager: reference counts, prefix caching (chained hashes, LRU eviction) and its invariant checks."""

from __future__ import annotations

import pytest

from ember.engine.block_manager import BlockManager
from ember.engine.sampling_params import SamplingParams
from ember.engine.sequence import Sequence

BLOCK = 4


def make_seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(f"r{seq_id}", seq_id, 0, tokens, SamplingParams())


def admit(bm: BlockManager, seq: Sequence) -> int:
    """What the scheduler does for a new sequence: reuse cached blocks, allocate the rest, "compute" it."""
    hits = bm.get_computed_blocks(seq)
    num_cached = len(hits) * bm.block_size
    assert bm.allocate(seq, seq.num_tokens - num_cached, hits)
    bm.record_prefix_lookup(seq.num_tokens, num_cached)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit_full_blocks(seq)
    return num_cached


def test_allocate_and_free_track_reference_counts():
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    seq = make_seq(list(range(10)))
    assert bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    assert all(bm.ref_counts[b] == 1 for b in seq.block_table)
    bm.check_invariants([seq])
    # Decoding inside the last block needs no new block; crossing the boundary takes exactly one.
    seq.num_computed_tokens = 10
    seq.token_ids.append(10)
    assert bm.allocate(seq, 1) and len(seq.block_table) == 3
    seq.num_computed_tokens = 12
    seq.token_ids.append(11)
    assert bm.allocate(seq, 1) and len(seq.block_table) == 4
    bm.check_invariants([seq])
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 8
    bm.check_invariants([seq])


def test_failed_allocation_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=BLOCK)
    first, second = make_seq(list(range(12)), 0), make_seq(list(range(100, 108)), 1)
    assert bm.allocate(first, 12)
    assert not bm.allocate(second, 8)
    assert second.block_table == [] and bm.num_free_blocks == 1
    bm.check_invariants([first, second])


def test_invariant_check_catches_a_leak_and_a_wrong_count():
    bm = BlockManager(num_blocks=4, block_size=BLOCK)
    seq = make_seq(list(range(6)))
    assert bm.allocate(seq, 6)
    with pytest.raises(AssertionError, match="ref count"):
        bm.check_invariants([])  # the holder is unknown: its blocks look leaked
    bm.ref_counts[seq.block_table[0]] += 1
    with pytest.raises(AssertionError, match="ref count 2"):
        bm.check_invariants([seq])


def test_double_free_is_detected():
    bm = BlockManager(num_blocks=4, block_size=BLOCK)
    seq = make_seq(list(range(6)))
    assert bm.allocate(seq, 6)
    stale_table = list(seq.block_table)
    bm.free(seq)
    seq.block_table = stale_table
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(seq)


def test_prefix_hit_reuses_full_blocks_and_counts_tokens():
    bm = BlockManager(num_blocks=16, block_size=BLOCK)
    first = make_seq(list(range(14)), 0)  # 3 full blocks + 2 tokens
    assert admit(bm, first) == 0
    second = make_seq(list(range(12)) + [99, 98, 97], 1)
    assert admit(bm, second) == 12
    assert second.block_table[:3] == first.block_table[:3]
    assert second.block_table[3] != first.block_table[3]
    assert all(bm.ref_counts[b] == 2 for b in first.block_table[:3])
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (14 + 15, 12)
    bm.check_invariants([first, second])
    bm.free(first)
    bm.free(second)
    bm.check_invariants([])
    # Freed cached blocks still serve hits; a fully cached prompt recomputes its last block.
    third = make_seq(list(range(12)), 2)
    assert admit(bm, third) == 8
    bm.check_invariants([third])


def test_chained_hash_needs_the_same_prefix():
    bm = BlockManager(num_blocks=16, block_size=BLOCK)
    admit(bm, make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], 0))
    # Same second block after a different first block: no hit at all.
    assert admit(bm, make_seq([0, 0, 0, 0, 5, 6, 7, 8, 9], 1)) == 0
    assert admit(bm, make_seq([1, 2, 3, 4, 0, 0, 0, 0, 9], 2)) == 4


def test_lru_eviction_prefers_uncached_then_oldest_cached_blocks():
    bm = BlockManager(num_blocks=6, block_size=BLOCK)
    old = make_seq(list(range(8)) + [50], 0)  # 2 full cached blocks + 1 partial (uncached)
    new = make_seq(list(range(100, 108)) + [51], 1)
    admit(bm, old)
    bm.free(old)
    admit(bm, new)
    bm.free(new)
    assert len(bm.cached) == 4
    # Two blocks' worth of demand: the two uncached partial blocks go first, no cache entry is lost.
    filler = make_seq(list(range(200, 208)), 2)
    assert bm.allocate(filler, 8)
    assert len(bm.cached) == 4
    # Two more: the least recently released cached blocks (old's) are evicted, newest survive.
    filler2 = make_seq(list(range(300, 308)), 3)
    assert bm.allocate(filler2, 8)
    assert len(bm.cached) == 2
    bm.check_invariants([filler, filler2])
    assert len(bm.get_computed_blocks(make_seq(list(range(100, 108)) + [52], 4))) == 2
    assert bm.get_computed_blocks(make_seq(list(range(8)) + [50], 5)) == []


def test_hit_on_a_free_cached_block_takes_it_out_of_the_free_queue():
    bm = BlockManager(num_blocks=3, block_size=BLOCK)
    first = make_seq(list(range(9)), 0)
    admit(bm, first)
    bm.free(first)
    second = make_seq(list(range(8)) + [77], 1)
    assert admit(bm, second) == 8
    assert bm.num_free_blocks == 0
    bm.check_invariants([second])
    # With nothing free, a hit that would need more than is left fails without touching anything.
    third = make_seq(list(range(8)) + [1, 2, 3, 4, 5], 2)
    hits = bm.get_computed_blocks(third)
    assert len(hits) == 2 and not bm.allocate(third, 5, hits)
    assert all(bm.ref_counts[b] == 1 for b in hits)
    bm.check_invariants([second, third])


def test_fork_shares_blocks_and_frees_them_once_per_holder():
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    parent = make_seq(list(range(10)), 0)
    admit(bm, parent)
    child = make_seq(list(range(10)), 1)
    bm.fork(parent, child, 2)
    assert child.block_table == parent.block_table[:2]
    assert [bm.ref_counts[b] for b in parent.block_table] == [2, 2, 1]
    child.num_computed_tokens = 8
    assert bm.allocate(child, 2)
    bm.check_invariants([parent, child])
    bm.free(parent)
    assert [bm.ref_counts[b] for b in child.block_table] == [1, 1, 1]
    bm.free(child)
    bm.check_invariants([])
    assert bm.num_free_blocks == 8


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=False)
    first = make_seq(list(range(9)), 0)
    admit(bm, first)
    bm.free(first)
    assert admit(bm, make_seq(list(range(9)), 1)) == 0
    assert bm.cached == {} and bm.prefix_cache_queries == 0
