"""Routing policies (one per file) and the layers the router puts in front of them:
canary (which deployment), region (which region), then the model's policy (which replica)."""

from ember.gateway.config import GatewayConfig, GatewayConfigError
from ember.gateway.routing.base import Choice, PolicyOptionsError, RoutingPolicy, parse_options
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



def validate_routing(config: GatewayConfig) -> None:
    """Check every model's `routing.options` against its policy's schema, as the router does when the
    gateway starts; GatewayConfigError naming the first bad model and option. Builds nothing, so
    `ember up` can refuse a bad fleet file before starting any process."""
    for name, model in config.models.items():
        try:
            parse_options(POLICIES[model.routing.policy].options_schema, model.routing.options)
        except PolicyOptionsError as exc:
            raise GatewayConfigError(f"models.{name}.routing.options: {exc}") from None


__all__ = ["POLICIES", "Choice", "PolicyOptionsError", "RoutingPolicy", "validate_routing"]
