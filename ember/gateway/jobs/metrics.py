"""Prometheus metrics of async jobs, batches and webhooks, registered in the gateway's registry so that
they appear on its `GET /metrics` next to the proxy's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

PREFIX = "ember_gateway_"


class JobMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        registry = registry if registry is not None else CollectorRegistry()
        self.submitted = Counter(
            PREFIX + "jobs_submitted",
            "Async jobs and batch requests accepted, by kind",
            ["kind"],
            registry=registry,
        )
        self.finished = Counter(
            PREFIX + "jobs_finished",
            "Async jobs and batch requests that reached a final state, by kind and state",
            ["kind", "status"],
            registry=registry,
        )
        self.requeued = Counter(
            PREFIX + "jobs_requeued",
            "Job runs that failed and were queued for another attempt (crash recovery included)",
            ["reason"],
            registry=registry,
        )
        self.webhook_attempts = Counter(
            PREFIX + "webhook_attempts",
            "Webhook delivery attempts, by outcome (delivered, retry, failed)",
            ["outcome"],
            registry=registry,
        )
