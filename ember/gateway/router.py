"""The router: for one request, which replica serves it.

    router = Router(config, pool)
    replica = router.select(model, ctx, exclude)   # None: nothing has a free slot right now

Three layers, each narrowing the previous one's choice:
  1. canary: the deployment (version), by traffic weight, among deployments with a usable replica
     (healthy and not in `exclude`, the replicas a failover retry already tried);
  2. region: the nearest region to the client with a free slot in that deployment (when the model
     has `routing.region_aware`, the default), and, with `routing.spill_when_waiting`, whose scraped
     queue is not building;
  3. the model's policy (`routing.policy`) among that region's usable replicas with a free slot.

Every decision is left in `ctx.extra["route"]` as a RouteDecision (deployment, region and policy
reasons) for logs and metrics. The router never acquires the slot: the caller does, on the event
loop thread, right after `select` returns.
"""

from __future__ import annotations

import random
from collections.abc import Collection
from dataclasses import dataclass

from ember.gateway.config import GatewayConfig
from ember.gateway.replicas import PoolEvent, Replica, ReplicaPool
from ember.gateway.request_context import RequestContext
from ember.gateway.routing import POLICIES, RoutingPolicy, validate_routing
from ember.gateway.routing.canary import CanarySplitter
from ember.gateway.routing.region import RegionSelector


@dataclass(frozen=True, slots=True)
class RouteDecision:
    replica: Replica | None
    policy: str
    reason: str  # the policy's reason, or why nothing was chosen ("saturated", "no-usable-replica", ...)
    deployment: str | None = None
    deployment_reason: str | None = None
    region: str | None = None
    region_reason: str | None = None


class Router:
    def __init__(self, config: GatewayConfig, pool: ReplicaPool, rng: random.Random | None = None):
        validate_routing(config)  # GatewayConfigError naming the model, before any policy is built
        self.pool = pool
        rng = rng or random.Random()
        self._policies: dict[str, RoutingPolicy] = {}
        self._region_aware: dict[str, bool] = {}
        self._spill_when_waiting: dict[str, int | None] = {}
        for name, model in config.models.items():
            policy_class = POLICIES[model.routing.policy]
            self._policies[name] = policy_class(model.routing.options, random.Random(rng.random()))
            self._region_aware[name] = model.routing.region_aware
            self._spill_when_waiting[name] = model.routing.spill_when_waiting
        self._canary = CanarySplitter(random.Random(rng.random()))
        self._regions = RegionSelector(config)
        pool.add_listener(self._on_pool_event)

    def policy(self, model: str) -> RoutingPolicy:
        return self._policies[model]

    def select(
        self, model: str, ctx: RequestContext, exclude: Collection[str] = frozenset()
    ) -> Replica | None:
        decision = self.decide(model, ctx, exclude)
        ctx.extra["route"] = decision
        return decision.replica

    def decide(
        self, model: str, ctx: RequestContext, exclude: Collection[str] = frozenset()
    ) -> RouteDecision:
        policy = self._policies.get(model)
        if policy is None:
            return RouteDecision(None, "", "unknown-model")
        replicas = self.pool.replicas(model)
        weights: dict[str, float] = {}
        for replica in replicas:
            if replica.healthy and replica.id not in exclude:
                weights[replica.deployment] = replica.weight
        deployment_pick = self._canary.pick(weights, ctx.session_id)
        if deployment_pick is None:
            return RouteDecision(None, policy.name, "no-usable-replica")
        deployment, deployment_reason = deployment_pick
        in_deployment = [replica for replica in replicas if replica.deployment == deployment]
        if self._region_aware[model]:
            region_pick = self._regions.pick(
                in_deployment, exclude, ctx.client_region, self._spill_when_waiting[model]
            )
            candidates, region, region_reason = region_pick.candidates, region_pick.region, region_pick.reason
        else:
            candidates = [r for r in in_deployment if r.has_capacity and r.id not in exclude]
            region, region_reason = None, None
        choice = policy.choose(candidates, ctx) if candidates else None
        if choice is None:
            return RouteDecision(
                None, policy.name, "saturated", deployment, deployment_reason, region, region_reason
            )
        return RouteDecision(
            choice.replica, policy.name, choice.reason, deployment, deployment_reason, region, region_reason
        )

    def _on_pool_event(self, event: PoolEvent, replica: Replica) -> None:
        # An ejected replica usually comes back restarted, its KV cache empty, and a removed one
        # never comes back: stop steering prefixes to it on the strength of what it held before.
        if event in ("eject", "remove"):
            forget = getattr(self._policies.get(replica.model), "forget", None)
            if forget is not None:
                forget(replica.id)
