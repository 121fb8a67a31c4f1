"""Round robin: each request goes to the next replica in turn.

The router hands over one deployment's replicas in one region at a time, so each such group keeps
its own turn: canary draws and spill-overs into another region do not skew the rotation."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from ember.gateway.replicas import Replica
from ember.gateway.request_context import RequestContext
from ember.gateway.routing.base import Choice, PolicyOptions, parse_options


class RoundRobinPolicy:
    name = "round-robin"
    options_schema = PolicyOptions

    def __init__(self, options: dict[str, Any] | None = None, rng: random.Random | None = None):
        parse_options(self.options_schema, options or {})
        self._turns: dict[tuple[str, str | None], int] = {}

    def choose(self, candidates: Sequence[Replica], ctx: RequestContext) -> Choice | None:
        if not candidates:
            return None
        group = (candidates[0].deployment, candidates[0].region)
        turn = self._turns.get(group, 0)
        self._turns[group] = turn + 1
        return Choice(candidates[turn % len(candidates)], "rotation")
