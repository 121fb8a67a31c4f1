"""Paged KV-cache blocks: reference counts, and automatic prefix caching.

A block is identified by the chained hash of its tokens (hash of the parent block's hash + this
block's token ids), so equal prefixes map to equal blocks. Only FULL, computed blocks are cached.
Free blocks sit in one LRU queue: never-cached blocks at the front (reused first), then cached
blocks in the order they were released; allocation takes from the front and evicts the cache entry
of a cached block it reuses. A cached block that is hit while free leaves the queue again."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable

from ember.engine.sequence import Sequence

ROOT_HASH = b"ember-prefix-root"


def hash_block(parent_hash: bytes, token_ids: list[int]) -> bytes:
    # sha256 rather than Python's hash(): a colliding prompt must never read another request's KV.
    return hashlib.sha256(parent_hash + array("i", token_ids).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks}x{block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -------------------------------------------------------------------------

    def _update_block_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        hashes = seq.block_hashes
        size = self.block_size
        tokens = seq.token_ids
        parent = hashes[-1] if hashes else ROOT_HASH
        for i in range(len(hashes), num_full_blocks):
            parent = hash_block(parent, tokens[i * size : (i + 1) * size])
            hashes.append(parent)

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of `seq` (always leaving at least one token to compute,
        so the model produces logits for the next token)."""
        if not self.enable_prefix_caching:
            return []
        # The last token must be computed, so a fully cached sequence still recomputes its last block.
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._update_block_hashes(seq, max_blocks)
        hits = []
        cached = self.cached
        for block_hash in seq.block_hashes[:max_blocks]:
            block_id = cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted sequence's lookup (failed admissions retry and must not count twice)."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register the seq's full, computed blocks in the prefix cache (call after the KV is written)."""
        num_full = seq.num_computed_tokens // self.block_size
        start = seq.num_committed_blocks
        if not self.enable_prefix_caching or num_full <= start:
            return
        self._update_block_hashes(seq, num_full)
        cached = self.cached
        for i in range(start, num_full):
            block_id = seq.block_table[i]
            block_hash = seq.block_hashes[i]
            if self.block_hash[block_id] is None and block_hash not in cached:
                self.block_hash[block_id] = block_hash
                cached[block_hash] = block_id
        seq.num_committed_blocks = num_full

    # ---- allocation ---------------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Make seq.block_table cover `computed_blocks` + seq.num_computed_tokens + num_new_tokens tokens.

        `computed_blocks` (from get_computed_blocks, only for a seq holding no blocks) are appended with
        their reference counts raised. Returns False, changing nothing, when the free blocks do not suffice."""
        table = seq.block_table
        num_tokens = seq.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_new_blocks = -(-num_tokens // self.block_size) - len(table) - len(computed_blocks)
        if num_new_blocks <= 0 and not computed_blocks:
            return True
        ref_counts = self.ref_counts
        revived = sum(1 for block_id in computed_blocks if ref_counts[block_id] == 0)
        if num_new_blocks + revived > len(self.free_queue):
            return False
        free_queue = self.free_queue
        for block_id in computed_blocks:
            if ref_counts[block_id] == 0:
                del free_queue[block_id]
            ref_counts[block_id] += 1
        table.extend(computed_blocks)
        if computed_blocks:
            seq.num_committed_blocks = len(table)
        for _ in range(num_new_blocks):
            block_id, _ = free_queue.popitem(last=False)
            evicted = self.block_hash[block_id]
            if evicted is not None:
                self.block_hash[block_id] = None
                del self.cached[evicted]
            ref_counts[block_id] = 1
            table.append(block_id)
        return True

    def free(self, seq: Sequence) -> None:
        """Release all the seq's blocks; later blocks first, so a prefix outlives its suffixes in the LRU."""
        ref_counts = self.ref_counts
        free_queue = self.free_queue
        for block_id in reversed(seq.block_table):
            count = ref_counts[block_id] - 1
            if count < 0:
                raise RuntimeError(f"double free of KV block {block_id} by {seq!r}")
            ref_counts[block_id] = count
            if count == 0:
                free_queue[block_id] = None
                if self.block_hash[block_id] is None:
                    free_queue.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_committed_blocks = 0

    def fork(self, parent: Sequence, child: Sequence, num_blocks: int) -> None:
        """Share the parent's first `num_blocks` (full, computed) blocks with a child holding none."""
        if child.block_table:
            raise RuntimeError(f"fork into {child!r}, which already holds blocks")
        shared = parent.block_table[:num_blocks]
        for block_id in shared:
            self.ref_counts[block_id] += 1
        child.block_table = shared
        child.num_committed_blocks = min(num_blocks, parent.num_committed_blocks)
        child.block_hashes = parent.block_hashes[:num_blocks]

    # ---- checks -------------------------------------------------------------------------------

    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        """Assert the accounting is exact given every sequence that may hold blocks."""
        expected = [0] * self.num_blocks
        for seq in seqs:
            table = seq.block_table
            assert len(set(table)) == len(table), f"{seq!r} holds a block twice: {table}"
            assert not table or seq.num_computed_tokens <= len(table) * self.block_size, (
                f"{seq!r} computed {seq.num_computed_tokens} tokens beyond its {len(table)} blocks"
            )
            assert not (seq.is_finished and table), f"finished {seq!r} still holds blocks {table}"
            for block_id in table:
                expected[block_id] += 1
        for block_id, (want, have) in enumerate(zip(expected, self.ref_counts, strict=True)):
            assert want == have, f"block {block_id}: ref count {have}, but {want} sequences hold it"
            assert (have == 0) == (block_id in self.free_queue), (
                f"block {block_id}: ref count {have} but {'' if have else 'not '}in the free queue"
            )
        assert len(self.free_queue) + sum(1 for c in self.ref_counts if c) == self.num_blocks, "block leak"
        for block_hash, block_id in self.cached.items():
            assert self.block_hash[block_id] == block_hash, f"cache entry of block {block_id} is stale"
        num_hashed = sum(1 for h in self.block_hash if h is not None)
        assert num_hashed == len(self.cached), "a block carries a hash that is not in the cache map"
