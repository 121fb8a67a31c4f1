"""The gateway's live view of its replicas: health, outstanding requests and the last scraped load.

Everything here runs on the gateway's event loop thread, so plain attributes need no locks.
The dispatcher acquires/releases capacity, the health prober and the proxy report successes and
failures, the scraper (ember.gateway.scraper) fills `Replica.metrics`, the router reads all of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from ember.gateway.config import GatewayConfig

PoolEvent = Literal["admit", "eject", "readmit", "release", "remove"]
PoolListener = Callable[[PoolEvent, "Replica"], None]


@dataclass(slots=True)
class ReplicaMetrics:
    """One scrape of a replica's /metrics (vLLM names or ember's); None where the server lacks it."""

    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None  # 0..1
    prefix_cache_hits: float | None = None  # tokens, cumulative counter
    prefix_cache_queries: float | None = None  # tokens, cumulative counter
    capacity: float | None = None  # a cluster gateway's: the capacity of its healthy replicas
    own_at_scrape: int = 0  # this gateway's requests on it while the scrape was under way, at most
    scraped_at: float = 0.0  # time.monotonic()


@dataclass(slots=True, eq=False)
class Replica:
    id: str
    url: str
    model: str  # the name clients use (the key under `models:`)
    upstream_model: str  # the id the replica serves; sent upstream as `model`
    deployment: str
    version: str | None
    weight: float  # the deployment's traffic weight
    region: str | None
    labels: dict[str, str]
    capacity: int
    api_key: str | None = field(default=None, repr=False)  # the replica's own key, never a client's
    healthy: bool = True
    # Configured replicas start un-admitted (healthy False) until their first successful probe.
    awaiting_first_probe: bool = False
    outstanding: int = 0
    acquired: int = 0  # requests ever sent to it (with `outstanding`, what a scrape may have counted of ours)
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    ejected_at: float | None = None
    ejection_reason: str | None = None
    metrics: ReplicaMetrics = field(default_factory=ReplicaMetrics)

    @property
    def auth_headers(self) -> dict[str, str]:
        """Headers of every request to the replica (proxied, probes, scrapes)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def has_capacity(self) -> bool:
        return self.healthy and self.outstanding < self.capacity

    def queue_building(self, waiting_threshold: int) -> bool:
        """Whether the last scrape says the next request would wait here: `waiting_threshold` or more
        requests queued, or (a cluster gateway) every slot of its healthy replicas taken. The running
        count is corrected by this gateway's own requests that ended or started since the scrape, so
        one client's back-to-back requests are not judged on the one before."""
        metrics = self.metrics
        if not metrics.scraped_at:
            return False
        if metrics.waiting is not None and metrics.waiting >= waiting_threshold:
            return True
        if metrics.capacity is None or metrics.running is None:
            return False
        return metrics.running - metrics.own_at_scrape + self.outstanding >= metrics.capacity

    @property
    def free_slots(self) -> int:
        return max(self.capacity - self.outstanding, 0) if self.healthy else 0


class ReplicaPool:
    """All replicas, grouped by the model name clients use."""

    def __init__(self, replicas: list[Replica], unhealthy_threshold: int = 3, healthy_threshold: int = 1):
        self._by_model: dict[str, list[Replica]] = {}
        self._by_id: dict[str, Replica] = {}
        for replica in replicas:
            self._by_model.setdefault(replica.model, []).append(replica)
            self._by_id[replica.id] = replica
        self.unhealthy_threshold = unhealthy_threshold
        self.healthy_threshold = healthy_threshold
        self._listeners: list[PoolListener] = []
        # Removed from routing, still finishing the requests they had (dynamic deregistration).
        self._draining: dict[str, Replica] = {}

    @classmethod
    def from_config(cls, config: GatewayConfig) -> ReplicaPool:
        replicas = []
        for model_name, model in config.models.items():
            for deployment in model.deployments:
                for replica in deployment.replicas:
                    replicas.append(
                        Replica(
                            id=replica.replica_id,
                            url=replica.url,
                            model=model_name,
                            upstream_model=deployment.model or model_name,
                            deployment=deployment.name,
                            version=deployment.version,
                            weight=deployment.weight,
                            region=replica.region,
                            labels=dict(replica.labels),
                            capacity=replica.capacity,
                            api_key=replica.replica_api_key or deployment.replica_api_key,
                            healthy=False,
                            awaiting_first_probe=True,
                        )
                    )
        return cls(replicas, config.health.unhealthy_threshold, config.health.healthy_threshold)

    # --- lookups -------------------------------------------------------------------------------

    @property
    def models(self) -> list[str]:
        return list(self._by_model)

    def replicas(self, model: str) -> list[Replica]:
        return self._by_model.get(model, [])

    def healthy(self, model: str) -> list[Replica]:
        return [replica for replica in self._by_model.get(model, []) if replica.healthy]

    def get(self, replica_id: str) -> Replica | None:
        return self._by_id.get(replica_id)

    def all(self) -> list[Replica]:
        return list(self._by_id.values())

    def draining(self) -> list[Replica]:
        return list(self._draining.values())

    # --- membership (static replicas come from the config; the autoscaler adds and removes more) ---

    def add(self, replica: Replica) -> None:
        """A new replica, ejected until its first successful health probe admits it."""
        replica.healthy = False
        replica.awaiting_first_probe = True
        self._by_model.setdefault(replica.model, []).append(replica)
        self._by_id[replica.id] = replica

    def remove(self, replica_id: str) -> Replica | None:
        """Takes a replica out of routing at once; it stays listed as draining until `forget_drained`."""
        replica = self._by_id.pop(replica_id, None)
        if replica is None:
            return None
        self._by_model[replica.model].remove(replica)
        self._draining[replica.id] = replica
        self._notify("remove", replica)
        return replica

    def forget_drained(self, replica: Replica) -> None:
        self._draining.pop(replica.id, None)

    # --- capacity ------------------------------------------------------------------------------

    def acquire(self, replica: Replica) -> None:
        replica.outstanding += 1
        replica.acquired += 1

    def release(self, replica: Replica) -> None:
        replica.outstanding -= 1
        self._notify("release", replica)

    # --- health --------------------------------------------------------------------------------

    def mark_success(self, replica: Replica) -> None:
        """A probe or request succeeded; admits a replica at its first success and re-admits an ejected
        one after `healthy_threshold` in a row."""
        replica.consecutive_failures = 0
        replica.consecutive_successes += 1
        if replica.awaiting_first_probe:
            replica.awaiting_first_probe = False
            replica.healthy = True
            self._notify("admit", replica)
        elif not replica.healthy and replica.consecutive_successes >= self.healthy_threshold:
            self.readmit(replica)

    def mark_failure(self, replica: Replica, reason: str, *, eject_now: bool = False) -> None:
        """A probe or request failed; ejects after `unhealthy_threshold` in a row, or at once when the
        failure proves the replica unreachable (connection refused/reset: passive ejection). A replica
        not yet admitted stays so (still loading, or never there: not an ejection)."""
        replica.consecutive_successes = 0
        replica.consecutive_failures += 1
        if replica.healthy and (eject_now or replica.consecutive_failures >= self.unhealthy_threshold):
            self.eject(replica, reason)

    def eject(self, replica: Replica, reason: str) -> None:
        if not replica.healthy:
            return
        replica.healthy = False
        replica.consecutive_successes = 0
        replica.ejected_at = time.monotonic()
        replica.ejection_reason = reason
        self._notify("eject", replica)

    def readmit(self, replica: Replica) -> None:
        if replica.healthy:
            return
        replica.healthy = True
        replica.consecutive_failures = 0
        replica.ejected_at = None
        replica.ejection_reason = None
        self._notify("readmit", replica)

    # --- listeners (metrics count ejections, the admission queue wakes on freed capacity) ------

    def add_listener(self, listener: PoolListener) -> None:
        self._listeners.append(listener)

    def _notify(self, event: PoolEvent, replica: Replica) -> None:
        for listener in self._listeners:
            listener(event, replica)
