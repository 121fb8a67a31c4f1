"""Replicas joining and leaving a running gateway: the one path for `/admin/replicas` (the autoscaler
of `ember up`) and for Kubernetes EndpointSlice discovery (ember.gateway.discovery).

A joining replica is un-admitted until its first successful health probe; a leaving one is out of
routing at once and listed as draining until its requests in flight finish (or the timeout passes).
"""

from __future__ import annotations

import asyncio
import time

from ember.gateway.config import DeploymentConfig
from ember.gateway.dispatch import Dispatcher
from ember.gateway.replicas import Replica

DRAIN_POLL_S = 0.05


def new_replica(
    model: str, deployment: DeploymentConfig, *, replica_id: str, url: str, region: str | None,
    labels: dict[str, str], capacity: int, api_key: str | None = None,
) -> Replica:  # fmt: skip
    return Replica(
        id=replica_id, url=url, model=model, upstream_model=deployment.model or model, deployment=deployment.name,
        version=deployment.version, weight=deployment.weight, region=region, labels=labels, capacity=capacity,
        api_key=api_key,
    )  # fmt: skip


async def join(dispatcher: Dispatcher, replica: Replica) -> None:
    """Adds the replica; admitted now if it already answers its probe, else by the prober later."""
    dispatcher.pool.add(replica)
    await dispatcher.health.probe(replica)


async def leave(dispatcher: Dispatcher, replica_id: str, timeout_s: float) -> Replica | None:
    """Out of routing at once; returns once its requests have finished or `timeout_s` passed (None: unknown)."""
    replica = dispatcher.pool.remove(replica_id)
    if replica is None:
        return None
    deadline = time.monotonic() + timeout_s
    while replica.outstanding > 0 and time.monotonic() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)
    dispatcher.pool.forget_drained(replica)
    return replica
