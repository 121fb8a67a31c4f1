"""Routing policies (one per file) and the layers the router puts in front of them:
canary (which deployment), region (which region), then the model's policy (which replica)."""

from ember.gateway.routing.base import Choice, PolicyOptionsError, RoutingPolicy
from ember.gateway.routing.least_outstanding import LeastOutstandingPolicy
from ember.gateway.routing.load_aware import LoadAwarePolicy
from ember.gateway.routing.prefix_cache import PrefixCachePolicy
from ember.gateway.routing.round_robin import RoundRobinPolicy
from ember.gateway.routing.session_affinity import SessionAffinityPolicy

POLICIES: dict[str, type] = {
    policy.name: policy
    for policy in (
        RoundRobinPolicy,
        LeastOutstandingPolicy,
        LoadAwarePolicy,
        PrefixCachePolicy,
        SessionAffinityPolicy,
    )
}

__all__ = ["POLICIES", "Choice", "PolicyOptionsError", "RoutingPolicy"]
