"""Round robin: each request goes to the next replica in turn."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from ember.gateway.replicas import Replica
from ember.gateway.request_context import RequestContext
from ember.gateway.routing.base import Choice, PolicyOptions, parse_options


class RoundRobinPolicy:
    name = "round-robin"

    def __init__(self, options: dict[str, Any] | None = None, rng: random.Random | None = None):
        parse_options(PolicyOptions, options or {})
        self._turn = 0

    def choose(self, candidates: Sequence[Replica], ctx: RequestContext) -> Choice | None:
        if not candidates:
            return None
        replica = candidates[self._turn % len(candidates)]
        self._turn += 1
        return Choice(replica, "rotation")
