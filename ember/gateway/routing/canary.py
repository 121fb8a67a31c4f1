"""Version canaries: which deployment (model version) of a model a request goes to, by traffic weight.

A request with a session always lands on the same deployment (weighted rendezvous hashing of the
session id), so one user does not flip between versions mid-conversation; other requests draw at
random in proportion to the weights. Deployments with weight 0 receive no traffic."""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Mapping

from ember.gateway.routing.base import rendezvous_score


class CanarySplitter:
    def __init__(self, rng: random.Random | None = None):
        self._rng = rng or random.Random()

    def pick(self, weights: Mapping[str, float], session_id: str | None) -> tuple[str, str] | None:
        """(deployment, reason) among `weights` (deployment -> weight), or None when all weigh 0."""
        live = {name: weight for name, weight in weights.items() if weight > 0}
        if not live:
            return None
        if len(live) == 1:
            return next(iter(live)), "only-deployment"
        if session_id:
            return max(live, key=lambda name: rendezvous_score(session_id, name, live[name])), "session"
        names = list(live)
        cumulative = list(itertools.accumulate(live.values()))
        point = self._rng.random() * cumulative[-1]
        return names[min(bisect.bisect_right(cumulative, point), len(names) - 1)], "weighted"
