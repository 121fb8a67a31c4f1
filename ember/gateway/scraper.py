"""Periodic scrape of each healthy replica's Prometheus /metrics into `Replica.metrics`, the load
snapshot the load-aware policy reads.

Understands ember's own names (`ember:`), vLLM's (`vllm:`, including v0's `gpu_cache_usage_perc`)
and SGLang's (`sglang:`); for each quantity the first name present wins, so a server exposing both
`ember:` and `vllm:` copies is not counted twice. Request counts are summed over a server's samples
(vLLM reports one per data-parallel engine); KV usage takes the fullest engine. A failed scrape
clears the snapshot rather than leaving stale numbers to route on.

A front door's replicas are cluster gateways: their load is the gateway's own `ember_gateway_` series
for the model the front door asks them for (a cluster gateway serves several models, one front-door
replica each): its admission queue depth (waiting), requests in flight on its replicas (running) and
the capacity of its healthy replicas (what it can run before its queue builds).
"""

from __future__ import annotations

import asyncio
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ember.gateway.config import ScrapeConfig
from ember.gateway.periodic import PeriodicTask
from ember.gateway.proxy import UpstreamClient
from ember.gateway.replicas import Replica, ReplicaMetrics, ReplicaPool

# Quantity -> sample names in order of preference.
SAMPLE_NAMES: dict[str, tuple[str, ...]] = {
    "waiting": (
        "ember:num_requests_waiting",
        "vllm:num_requests_waiting",
        "sglang:num_queue_reqs",
        "ember_gateway_queue_depth",
    ),
    "running": (
        "ember:num_requests_running",
        "vllm:num_requests_running",
        "sglang:num_running_reqs",
        "ember_gateway_replica_outstanding",
    ),
    "kv_usage": (
        "ember:kv_cache_usage_perc",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "sglang:token_usage",
    ),
    "prefix_cache_hits": ("ember:prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
    "prefix_cache_queries": ("ember:prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
}
# A cluster gateway's replicas: `healthy` (0/1) and `capacity` per replica, paired into the capacity
# of its healthy replicas.
GATEWAY_HEALTHY = "ember_gateway_replica_healthy"
GATEWAY_CAPACITY = "ember_gateway_replica_capacity"
_WANTED = {name for names in SAMPLE_NAMES.values() for name in names} | {GATEWAY_HEALTHY, GATEWAY_CAPACITY}
_GATEWAY_PREFIX = "ember_gateway_"
# A vLLM /metrics page is mostly histogram buckets; only these lines are worth parsing.
_LINE_PREFIXES = tuple(name + end for name in _WANTED for end in ("{", " "))


def parse_load_metrics(text: str, model: str | None = None) -> ReplicaMetrics:
    """The load snapshot in a Prometheus text exposition; None for quantities it lacks. `model`: the
    model whose `ember_gateway_` series count (a cluster gateway's other models are not this load)."""
    relevant = "\n".join(line for line in text.splitlines() if line.startswith(_LINE_PREFIXES))
    samples: dict[str, list[float]] = {}
    healthy: dict[str, float] = {}  # a cluster gateway's replica id -> 1.0 when admitted
    capacity: dict[str, float] = {}
    for family in text_string_to_metric_families(relevant + "\n"):
        for sample in family.samples:
            if sample.name not in _WANTED:
                continue
            if sample.name.startswith(_GATEWAY_PREFIX) and sample.labels.get("model") != model:
                continue
            if sample.name == GATEWAY_HEALTHY:
                healthy[sample.labels.get("replica", "")] = float(sample.value)
            elif sample.name == GATEWAY_CAPACITY:
                capacity[sample.labels.get("replica", "")] = float(sample.value)
            else:
                samples.setdefault(sample.name, []).append(float(sample.value))
    snapshot = ReplicaMetrics()
    for quantity, names in SAMPLE_NAMES.items():
        values = next((samples[name] for name in names if name in samples), None)
        if values is not None:
            setattr(snapshot, quantity, max(values) if quantity == "kv_usage" else sum(values))
    if healthy:
        snapshot.capacity = sum(capacity.get(replica, 0.0) for replica, up in healthy.items() if up)
    return snapshot


class MetricsScraper:
    def __init__(self, pool: ReplicaPool, client: UpstreamClient, config: ScrapeConfig):
        self.pool = pool
        self.client = client
        self.config = config
        self._task = PeriodicTask("ember-gateway-scraper", config.interval_s, self.scrape_all)

    async def start(self) -> None:
        await self._task.start()

    async def stop(self) -> None:
        await self._task.stop()

    async def scrape_all(self) -> None:
        for replica in self.pool.all():
            if not replica.healthy and replica.metrics.scraped_at:
                replica.metrics = ReplicaMetrics()  # re-admitted later, it must not be judged on old load
        await asyncio.gather(*(self.scrape(replica) for replica in self.pool.all() if replica.healthy))

    async def scrape(self, replica: Replica) -> bool:
        """One scrape into `replica.metrics`; returns whether it succeeded."""
        # Ours among the requests it reports: those in flight when the scrape left, and any sent since.
        own_before, acquired_before = replica.outstanding, replica.acquired
        try:
            response = await self.client.side.get(
                replica.url + self.config.path, headers=replica.auth_headers, timeout=self.config.timeout_s
            )
            text = response.text
            ok = response.status_code == 200
        except httpx.HTTPError:
            ok = False
        snapshot = None
        if ok:
            try:
                snapshot = parse_load_metrics(text, replica.upstream_model)
            except ValueError:  # a malformed exposition
                snapshot = None
        # No known load quantity at all (an HTML page, a server without load metrics) is no snapshot.
        if snapshot is None or all(getattr(snapshot, quantity) is None for quantity in SAMPLE_NAMES):
            replica.metrics = ReplicaMetrics()
            return False
        snapshot.scraped_at = time.monotonic()
        snapshot.own_at_scrape = own_before + replica.acquired - acquired_before
        replica.metrics = snapshot
        return True
