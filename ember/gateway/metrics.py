"""The gateway's own Prometheus metrics (`GET /metrics`), in a registry per gateway instance.

Replica state (healthy, outstanding, capacity) is read from the pool at scrape time instead of being
mirrored into gauges on every request.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ember.gateway.console.series import ConsoleSeries
from ember.gateway.keys import Principal
from ember.gateway.replicas import ReplicaPool

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
PREFIX = "ember_gateway_"


class _PoolCollector(Collector):
    def __init__(self, pool: ReplicaPool):
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["model", "replica", "deployment", "region"]
        healthy = GaugeMetricFamily(
            PREFIX + "replica_healthy", "1 if the replica is admitted, 0 if ejected or not yet admitted", labels=labels
        )
        outstanding = GaugeMetricFamily(
            PREFIX + "replica_outstanding", "Requests the gateway has in flight on the replica", labels=labels
        )
        capacity = GaugeMetricFamily(PREFIX + "replica_capacity", "Configured max concurrent requests", labels=labels)
        for replica in self.pool.all():
            values = [replica.model, replica.id, replica.deployment, replica.region or ""]
            healthy.add_metric(values, 1.0 if replica.healthy else 0.0)
            outstanding.add_metric(values, replica.outstanding)
            capacity.add_metric(values, replica.capacity)
        yield healthy
        yield outstanding
        yield capacity


def cached_labels(metric):
    return functools.lru_cache(maxsize=16384)(metric.labels)


class GatewayMetrics:
    def __init__(self, key_labels: str = "name") -> None:
        """`key_labels` (config `metrics.key_labels`): what per-key series carry in their `key`
        label, the key's name, its id, or "" (one series for all keys)."""
        self.key_labels = key_labels
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            PREFIX + "requests", "Requests by model, key, replica and HTTP status",
            ["model", "key", "replica", "status"], registry=r,
        )  # fmt: skip
        self.queue_depth = Gauge(PREFIX + "queue_depth", "Requests waiting for capacity", ["model"], registry=r)
        self.queue_wait = Histogram(
            PREFIX + "queue_wait_seconds", "Time spent waiting in the admission queue", ["model"],
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Arrival at the gateway to the first byte/chunk from the replica",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Arrival at the gateway to the end of the response",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.routing_decisions = Counter(
            PREFIX + "routing_decisions", "Replicas chosen, by routing policy and its reason",
            ["model", "policy", "replica", "reason"],
            registry=r,
        )  # fmt: skip
        self.retries = Counter(
            PREFIX + "retries", "Requests retried on another replica before their first byte", ["model", "reason"],
            registry=r,
        )  # fmt: skip
        self.ejections = Counter(
            PREFIX + "ejections", "Replicas ejected from routing", ["replica", "reason"], registry=r
        )
        self.readmissions = Counter(PREFIX + "readmissions", "Ejected replicas re-admitted", ["replica"], registry=r)
        self.rate_limited = Counter(
            PREFIX + "rate_limited", "Requests refused with 429, by key and limit", ["key", "limit"], registry=r
        )
        self.tokens = Counter(PREFIX + "tokens", "Tokens used, by key and kind", ["key", "kind"], registry=r)
        # The proxy path looks label children up on every request: memoise the lookups.
        self.request_count = cached_labels(self.requests)
        self.ttft_for = cached_labels(self.ttft)
        self.e2e_for = cached_labels(self.e2e)
        self.routing_for = cached_labels(self.routing_decisions)
        self.tokens_for = cached_labels(self.tokens)
        self.series = ConsoleSeries()  # the console's last hour, fed by the observe_* calls below

    # Each event is recorded here once, for both Prometheus and the console's series.

    def count_request(self, model: str, key: str, replica: str, status: str) -> None:
        self.request_count(model, key, replica, status).inc()
        self.series.request(status)

    def observe_ttft(self, model: str, seconds: float) -> None:
        self.ttft_for(model).observe(seconds)
        self.series.ttft(seconds)

    def observe_completion(self, model: str, e2e_seconds: float, output_tokens: int, ttft_seconds: float | None) -> None:
        """A request's end; the mean inter-token latency of a stream is the time after its first
        token over the tokens that followed it."""
        self.e2e_for(model).observe(e2e_seconds)
        itl = None
        if ttft_seconds is not None and output_tokens > 1:
            itl = (e2e_seconds - ttft_seconds) / (output_tokens - 1)
        self.series.completion(output_tokens, itl)

    def set_queue_depth(self, model: str, depth: int) -> None:
        self.queue_depth.labels(model).set(depth)
        self.series.queue(depth)

    def observe_queue_wait(self, model: str, seconds: float) -> None:
        self.queue_wait.labels(model).observe(seconds)
        self.series.queue_wait(seconds)

    def key_label(self, principal: Principal) -> str:
        if self.key_labels == "name":
            return principal.name
        return principal.key_id if self.key_labels == "id" else ""

    def watch_pool(self, pool: ReplicaPool) -> None:
        self.registry.register(_PoolCollector(pool))
        self.series.healthy_replicas = lambda: sum(1 for replica in pool.all() if replica.healthy)

        def on_event(event: str, replica) -> None:
            if event == "eject":
                self.ejections.labels(replica.id, replica.ejection_reason or "unknown").inc()
            elif event == "readmit":
                self.readmissions.labels(replica.id).inc()

        pool.add_listener(on_event)

    def render(self) -> bytes:
        return generate_latest(self.registry)
