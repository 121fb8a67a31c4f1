"""Prefix-cache-aware: send requests whose prompts share a prefix to the replica that already holds
that prefix in its KV cache, bounded by load (the approach of SGLang's cache-aware router).

The gateway does not tokenize, so it tracks prompt *text*: the prompt (chat messages rendered to one
canonical string by RequestContext.prompt_text) is cut into fixed-size character blocks and each
block gets a hash chained to all blocks before it, like vLLM's KV block hashes. A replica "holds"
block i exactly when it was sent a prompt whose first i blocks were the same, so the leading run of
a prompt's hashes found for a replica is the length of the prefix it can reuse.

Per request:
  1. match: the candidate holding the longest prefix (ties: fewer requests in flight);
  2. if that prefix is at least `cache_threshold` of the prompt, choose it ("cache-hit"); otherwise
     choose the candidate tracking the fewest blocks, to spread new prefixes ("cache-miss");
  3. bounded by load: if the choice has more than `balance_abs_threshold` requests in flight above
     the least-loaded candidate and more than `balance_rel_threshold` times its count, take the
     least-loaded one instead ("balance");
  4. record the prompt's blocks for the chosen replica.

Each replica's blocks are kept in LRU order, capped at `max_blocks_per_replica` to mirror a KV cache
of bounded size; a prompt's blocks are recorded deepest first, so that its shorter prefixes are the
most recent and a replica's chains are evicted from their tails, never leaving an unreachable tail.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import Field

from ember.gateway.replicas import Replica
from ember.gateway.request_context import RequestContext
from ember.gateway.routing.base import Choice, PolicyOptions, least_utilized, parse_options


class PrefixCacheOptions(PolicyOptions):
    # ~16 tokens of English: the granularity at which ember and vLLM reuse KV-cache blocks.
    block_chars: int = Field(default=64, ge=1, description="Characters per hashed prompt block")
    cache_threshold: float = Field(
        default=0.3, ge=0, le=1, description="Min matched fraction of the prompt to follow the cache"
    )
    balance_abs_threshold: int = Field(default=4, ge=0, description="Requests in flight above the least loaded")
    balance_rel_threshold: float = Field(default=1.5, ge=1, description="...and this many times its count")
    max_blocks_per_replica: int = Field(default=16_384, gt=0, description="LRU bound of tracked blocks")


def prompt_key(ctx: RequestContext) -> str:
    """The text whose prefixes are tracked: the prompt as text, or a completions prompt given as token
    ids (as load generators send it) spelled out as numbers, so that shared token prefixes match too."""
    text = ctx.prompt_text
    if text or ctx.endpoint != "completions":
        return text
    prompt = ctx.body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and all(isinstance(token, int) for token in prompt):
        return " ".join(map(str, prompt))
    return ""


class PrefixIndex:
    """Which replica was sent which prompt prefixes, as chained block hashes with per-replica LRU.

    Invariant: a replica holding a block holds every block before it in the chain (recording a
    prompt touches its shorter prefixes last, so eviction never takes a block before its
    descendants). Holding is therefore monotone along a prompt, and the matched length is found by
    binary search: O(log blocks) lookups per replica."""

    def __init__(self, block_chars: int, max_blocks_per_replica: int):
        self.block_chars = block_chars
        self.max_blocks_per_replica = max_blocks_per_replica
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def block_hashes(self, text: str) -> list[int]:
        # Python's salted str hash is fine here: the index lives and dies with this process.
        size = self.block_chars
        hashes: list[int] = []
        previous = 0
        for start in range(0, len(text) - size + 1, size):
            previous = hash((previous, text[start : start + size]))
            hashes.append(previous)
        return hashes

    def match(self, hashes: Sequence[int], replica_ids: Iterable[str]) -> dict[str, int]:
        """Leading blocks of `hashes` each replica holds."""
        matched = {}
        for replica_id in replica_ids:
            held = self._lru.get(replica_id)
            low, high = 0, len(hashes) if held else 0
            while low < high:  # the longest prefix whose last block is held
                middle = (low + high + 1) // 2
                if hashes[middle - 1] in held:
                    low = middle
                else:
                    high = middle - 1
            matched[replica_id] = low
        return matched

    def insert(self, hashes: Sequence[int], replica_id: str) -> None:
        lru = self._lru.setdefault(replica_id, OrderedDict())
        for block in reversed(hashes):
            lru[block] = None
            lru.move_to_end(block)
        while len(lru) > self.max_blocks_per_replica:
            lru.popitem(last=False)

    def forget(self, replica_id: str) -> None:
        """Drop everything recorded for a replica (it restarted, so its KV cache is empty)."""
        self._lru.pop(replica_id, None)

    def size(self, replica_id: str) -> int:
        lru = self._lru.get(replica_id)
        return len(lru) if lru is not None else 0


class PrefixCachePolicy:
    name = "prefix-cache"
    options_schema = PrefixCacheOptions

    def __init__(self, options: dict[str, Any] | None = None, rng: random.Random | None = None):
        self.options = parse_options(self.options_schema, options or {})
        self.index = PrefixIndex(self.options.block_chars, self.options.max_blocks_per_replica)
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[Replica], ctx: RequestContext) -> Choice | None:
        if not candidates:
            return None
        hashes = self.index.block_hashes(prompt_key(ctx))
        if not hashes:
            return Choice(least_utilized(candidates, self._rng), "no-prefix")
        matched = self.index.match(hashes, (replica.id for replica in candidates))
        best = max(candidates, key=lambda replica: (matched[replica.id], -replica.outstanding))
        if matched[best.id] / len(hashes) >= self.options.cache_threshold:
            target, reason = best, "cache-hit"
        else:
            fewest = min(self.index.size(replica.id) for replica in candidates)
            roomiest = [replica for replica in candidates if self.index.size(replica.id) == fewest]
            target, reason = least_utilized(roomiest, self._rng), "cache-miss"
        least_loaded = min(candidates, key=lambda replica: replica.outstanding)
        if self._overloaded(target.outstanding, least_loaded.outstanding):
            target, reason = least_loaded, "balance"
        self.index.insert(hashes, target.id)
        return Choice(target, reason)

    def forget(self, replica_id: str) -> None:
        self.index.forget(replica_id)

    def _overloaded(self, load: int, lowest: int) -> bool:
        options = self.options
        return load - lowest > options.balance_abs_threshold and load > options.balance_rel_threshold * lowest
