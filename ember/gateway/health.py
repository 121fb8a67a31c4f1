"""Active health probes: GET <replica>/health every `health.interval_s`; `unhealthy_threshold`
failures in a row eject a replica, `healthy_threshold` successes in a row re-admit it."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp

from ember.gateway.config import HealthConfig
from ember.gateway.proxy import UpstreamClient
from ember.gateway.replicas import Replica, ReplicaPool


class HealthProber:
    def __init__(self, pool: ReplicaPool, client: UpstreamClient, config: HealthConfig):
        self.pool = pool
        self.client = client
        self.config = config
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="ember-gateway-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(replica) for replica in self.pool.all()))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            await self.probe_all()

    async def _probe(self, replica: Replica) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
        try:
            async with self.client.session.get(replica.url + self.config.path, timeout=timeout) as response:
                await response.read()
                healthy = response.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            healthy = False
        if healthy:
            self.pool.mark_success(replica)
        else:
            self.pool.mark_failure(replica, "health_probe")
