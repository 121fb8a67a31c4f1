"""Least outstanding requests by the power of two choices: sample two replicas at random and take
the one with fewer requests in flight (relative to its capacity).

Sampling two instead of scanning all keeps a burst of simultaneous decisions from piling onto the
single least-loaded replica while still steering away from busy ones (Mitzenmacher, 2001)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from ember.gateway.replicas import Replica
from ember.gateway.request_context import RequestContext
from ember.gateway.routing.base import Choice, PolicyOptions, least_utilized, parse_options


class LeastOutstandingPolicy:
    name = "least-outstanding"
    options_schema = PolicyOptions

    def __init__(self, options: dict[str, Any] | None = None, rng: random.Random | None = None):
        parse_options(self.options_schema, options or {})
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[Replica], ctx: RequestContext) -> Choice | None:
        if not candidates:
            return None
        if len(candidates) == 1:
            return Choice(candidates[0], "only-candidate")
        pair = self._rng.sample(list(candidates), 2)
        return Choice(least_utilized(pair, self._rng), "two-choices")
