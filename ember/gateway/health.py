"""Active health probes: GET <replica><health.path> for every replica every `health.interval_s`.
A 2xx answer within `health.timeout_s` is a success; anything else (refused, reset, timeout, 5xx such
as a server still loading its model) is a failure. Replicas start un-admitted: the first success
admits one, and the gateway starts serving only after a first round of probes. Then
`unhealthy_threshold` failures in a row eject a replica and `healthy_threshold` successes in a row
re-admit it (ReplicaPool keeps the counts, shared with the proxy's passive failures)."""

from __future__ import annotations

import asyncio
import logging

import httpx

from ember.gateway.config import HealthConfig
from ember.gateway.periodic import PeriodicTask
from ember.gateway.proxy import UpstreamClient
from ember.gateway.replicas import Replica, ReplicaPool

logger = logging.getLogger("ember.gateway")


class HealthProber:
    def __init__(self, pool: ReplicaPool, client: UpstreamClient, config: HealthConfig):
        self.pool = pool
        self.client = client
        self.config = config
        self._task = PeriodicTask("ember-gateway-health", config.interval_s, self.probe_all)

    async def start(self) -> None:
        """One round of probes, so replicas already up are admitted before the first request, then one
        every interval."""
        await self.probe_all()
        await self._task.start(first_round_after_s=self.config.interval_s)

    async def stop(self) -> None:
        await self._task.stop()

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(replica) for replica in self.pool.all()))

    async def probe(self, replica: Replica) -> bool:
        """One probe; reports the outcome to the pool and returns whether it succeeded."""
        failure = None
        try:
            response = await self.client.side.get(
                replica.url + self.config.path, headers=replica.auth_headers, timeout=self.config.timeout_s
            )
            if not 200 <= response.status_code < 300:
                failure = f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            failure = type(exc).__name__
        was_healthy = replica.healthy
        if failure is None:
            self.pool.mark_success(replica)
        else:
            self.pool.mark_failure(replica, "health_probe")
        if replica.healthy != was_healthy:
            if replica.healthy:
                logger.info("replica %s admitted: health probe passed", replica.id)
            else:
                logger.warning("replica %s ejected: health probe failed (%s)", replica.id, failure)
        return failure is None
