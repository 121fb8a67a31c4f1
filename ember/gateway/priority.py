"""Ember's one priority convention: a higher number is more important, wherever a user sets one
(a key's `priority` and `max_priority` tiers, the `x-ember-priority` header, the WebSocket frame's
and gRPC request's `priority`, an async job's `priority`).

The engine behind each replica (`ember serve`, like vLLM) serves and preempts the *lowest* value
first. That value is the gateway's to set: it writes the body's `priority` for the replica from the
request's tier, `engine_priority(tier)`, and never forwards the client's own `priority` field, which
would otherwise let any key jump the replica's queue.
"""

from __future__ import annotations

from ember.gateway.config import KeyPolicy

# Below every key's tier (tiers are >= 0): async jobs and batches wait behind interactive traffic.
BACKGROUND_TIER = -1


def request_tier(policy: KeyPolicy, requested: int | None, is_background: bool) -> int:
    """The tier a request runs at: the key's own unless it asks for another, which may be any lower
    tier or up to the key's `max_priority` (capped there)."""
    if is_background:
        return BACKGROUND_TIER
    if requested is None:
        return policy.priority
    return min(max(requested, 0), policy.highest_priority)


def engine_priority(tier: int) -> int:
    """The replica engine's priority (lower first) for a gateway tier (higher first)."""
    return -tier
