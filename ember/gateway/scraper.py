"""Periodic scrape of each healthy replica's Prometheus /metrics into `Replica.metrics`, the load
snapshot the load-aware policy reads.

Understands ember's own names (`ember:`), vLLM's (`vllm:`, including v0's `gpu_cache_usage_perc`)
and SGLang's (`sglang:`); for each quantity the first name present wins, so a server exposing both
`ember:` and `vllm:` copies is not counted twice. Request counts are summed over a server's samples
(vLLM reports one per data-parallel engine); KV usage takes the fullest engine. A failed scrape
clears the snapshot rather than leaving stale numbers to route on.
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
    "waiting": ("ember:num_requests_waiting", "vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "running": ("ember:num_requests_running", "vllm:num_requests_running", "sglang:num_running_reqs"),
    "kv_usage": (
        "ember:kv_cache_usage_perc",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "sglang:token_usage",
    ),
    "prefix_cache_hits": ("ember:prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
    "prefix_cache_queries": ("ember:prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
}
_WANTED = {name for names in SAMPLE_NAMES.values() for name in names}
# A vLLM /metrics page is mostly histogram buckets; only these lines are worth parsing.
_LINE_PREFIXES = tuple(name + end for name in _WANTED for end in ("{", " "))


def parse_load_metrics(text: str) -> ReplicaMetrics:
    """The load snapshot in a Prometheus text exposition; None for quantities it lacks."""
    relevant = "\n".join(line for line in text.splitlines() if line.startswith(_LINE_PREFIXES))
    samples: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(relevant + "\n"):
        for sample in family.samples:
            if sample.name in _WANTED:
                samples.setdefault(sample.name, []).append(float(sample.value))
    snapshot = ReplicaMetrics()
    for quantity, names in SAMPLE_NAMES.items():
        values = next((samples[name] for name in names if name in samples), None)
        if values is not None:
            setattr(snapshot, quantity, max(values) if quantity == "kv_usage" else sum(values))
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
                snapshot = parse_load_metrics(text)
            except ValueError:  # a malformed exposition
                snapshot = None
        # No known load quantity at all (an HTML page, a server without load metrics) is no snapshot.
        if snapshot is None or all(getattr(snapshot, quantity) is None for quantity in SAMPLE_NAMES):
            replica.metrics = ReplicaMetrics()
            return False
        snapshot.scraped_at = time.monotonic()
        replica.metrics = snapshot
        return True
