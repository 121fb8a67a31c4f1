"""Session affinity: every request of one session (the `user` field or the x-ember-session-id
header, see RequestContext.session_id) goes to the same replica, by weighted rendezvous hashing over
the candidates (weight = capacity). When that replica leaves (ejected, or at capacity), only its
sessions move, each to its runner-up; all others stay put. Requests without a session go to the
least-utilized candidate."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from ember.gateway.replicas import Replica
from ember.gateway.request_context import RequestContext
from ember.gateway.routing.base import Choice, PolicyOptions, least_utilized, parse_options, rendezvous_score


class SessionAffinityPolicy:
    name = "session-affinity"
    options_schema = PolicyOptions

    def __init__(self, options: dict[str, Any] | None = None, rng: random.Random | None = None):
        parse_options(self.options_schema, options or {})
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[Replica], ctx: RequestContext) -> Choice | None:
        if not candidates:
            return None
        session = ctx.session_id
        if not session:
            return Choice(least_utilized(candidates, self._rng), "no-session")
        replica = max(candidates, key=lambda replica: rendezvous_score(session, replica.id, replica.capacity))
        return Choice(replica, "session")
