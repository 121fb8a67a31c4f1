"""The one protocol every routing policy implements, and the helpers they share.

A policy sees only candidates the router already filtered: healthy, not excluded by a failover
retry, inside the chosen deployment and region, and with free capacity (never an empty list).
It returns the replica to use plus a short reason that the gateway counts in its metrics.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

from pydantic import ValidationError

from ember.gateway.replicas import Replica
from ember.gateway.request_context import RequestContext
from ember.strict_model import StrictModel


class Choice(NamedTuple):
    replica: Replica
    reason: str  # e.g. "rotation", "cache-hit", "balance": a low-cardinality metric label


class RoutingPolicy(Protocol):
    name: str
    options_schema: type[PolicyOptions]  # what `routing.options` may hold for this policy

    def choose(self, candidates: Sequence[Replica], ctx: RequestContext) -> Choice | None: ...


class PolicyOptions(StrictModel):
    """Base of each policy's `routing.options` schema: unknown knobs are an error, not ignored."""


class PolicyOptionsError(ValueError):
    """`routing.options` does not fit the policy; the message names each bad option."""


OptionsT = TypeVar("OptionsT", bound=PolicyOptions)


def parse_options(schema: type[OptionsT], options: dict[str, Any]) -> OptionsT:
    try:
        return schema.model_validate(options)
    except ValidationError as exc:
        problems = []
        for item in exc.errors():
            where = ".".join(str(part) for part in item["loc"]) or "options"
            problems.append(f"{where}: {item['msg'].removeprefix('Value error, ')}")
        raise PolicyOptionsError("; ".join(problems)) from None


def stable_hash(*parts: str) -> int:
    """A 64-bit hash that is the same in every process (Python's `hash` of str is salted per process,
    and two gateway instances must send one session to the same replica)."""
    digest = hashlib.blake2b("\0".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def unit_interval(*parts: str) -> float:
    """`stable_hash` mapped into (0, 1), never exactly 0 or 1."""
    return (stable_hash(*parts) + 0.5) / 2.0**64


def utilization(replica: Replica) -> float:
    return replica.outstanding / replica.capacity


def least_utilized(candidates: Sequence[Replica], rng: random.Random) -> Replica:
    """The candidate with the lowest outstanding/capacity ratio; ties broken at random so that equal
    replicas share the traffic instead of the first in config order taking all of it."""
    lowest = min(utilization(replica) for replica in candidates)
    tied = [replica for replica in candidates if utilization(replica) == lowest]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def rendezvous_score(key: str, member: str, weight: float) -> float:
    """Weighted rendezvous (highest-random-weight) hashing: the member with the highest score for a key
    wins; each member wins a share of keys proportional to its weight, and when a member leaves only
    the keys it held move (to each key's runner-up), so every other key stays where it was."""
    return -weight / math.log(unit_interval(key, member))
