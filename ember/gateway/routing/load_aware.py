"""Load-aware: the replica with the lowest load score, from its scraped /metrics (ember:, vllm: or
sglang: names, see ember.gateway.scraper) plus the gateway's own live count of requests in flight.

    score = waiting_weight * waiting + running_weight * running + kv_usage_weight * kv_usage
            + outstanding_weight * outstanding

The live term matters because scrapes are seconds apart: without it every request between two
scrapes would herd onto the replica that looked idlest at the last scrape. A snapshot older than
`max_staleness_s` (or none yet) counts as zero load, leaving only the live term."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

from pydantic import Field

from ember.gateway.replicas import Replica
from ember.gateway.request_context import RequestContext
from ember.gateway.routing.base import Choice, PolicyOptions, parse_options


class LoadAwareOptions(PolicyOptions):
    waiting_weight: float = Field(default=1.0, ge=0)
    running_weight: float = Field(default=0.25, ge=0)
    # kv_usage is 0..1: a full KV cache weighs like four queued requests.
    kv_usage_weight: float = Field(default=4.0, ge=0)
    outstanding_weight: float = Field(default=1.0, ge=0)
    max_staleness_s: float = Field(default=10.0, gt=0)


def load_score(replica: Replica, options: LoadAwareOptions, now: float) -> float:
    score = options.outstanding_weight * replica.outstanding
    metrics = replica.metrics
    if metrics.scraped_at > 0 and now - metrics.scraped_at <= options.max_staleness_s:
        score += options.waiting_weight * (metrics.waiting or 0.0)
        score += options.running_weight * (metrics.running or 0.0)
        score += options.kv_usage_weight * (metrics.kv_usage or 0.0)
    return score


class LoadAwarePolicy:
    name = "load-aware"
    options_schema = LoadAwareOptions

    def __init__(self, options: dict[str, Any] | None = None, rng: random.Random | None = None):
        self.options = parse_options(self.options_schema, options or {})
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[Replica], ctx: RequestContext) -> Choice | None:
        if not candidates:
            return None
        now = time.monotonic()
        scores = [load_score(replica, self.options, now) for replica in candidates]
        lowest = min(scores)
        tied = [replica for replica, score in zip(candidates, scores, strict=True) if score == lowest]
        return Choice(tied[0] if len(tied) == 1 else self._rng.choice(tied), "lowest-load")
