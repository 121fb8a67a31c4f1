"""Region-aware selection: the client's region (x-ember-region, else the listener's region) is
served by the nearest region, by the configured latency matrix, that has a healthy replica with a
free slot. The region itself comes first (latency 0), then the others by latency; pairs missing from
the matrix count as infinitely far but are still used as the last resort.

A request leaves its nearest region only when that region cannot take it: every replica there is
ejected or excluded ("spill-outage") or every healthy one is at capacity ("spill-overload"). With
`routing.spill_when_waiting` (a front door's clusters), a replica whose last scrape shows its queue
building counts as at capacity too, unless every region's is: then the nearest with a free slot
serves ("overloaded"), since the request would wait wherever it went.
Without a client region, or with one the config never names, every region is equally good."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from ember.gateway.config import GatewayConfig
from ember.gateway.replicas import Replica


@dataclass(frozen=True, slots=True)
class RegionPick:
    candidates: list[Replica]  # usable replicas with a free slot in the chosen region; empty: none anywhere
    region: str | None
    reason: str  # local | nearest | spill-outage | spill-overload | overloaded | any-region | saturated


class RegionSelector:
    def __init__(self, config: GatewayConfig):
        self._config = config
        # Only regions named in the config are ordered (and cached): a header naming anything else
        # gets no preference rather than growing the cache.
        self._known = set(config.regions) | {
            replica.region
            for model in config.models.values()
            for deployment in model.deployments
            for replica in deployment.replicas
            if replica.region is not None
        }
        self._order_cache: dict[tuple[str, tuple[str | None, ...]], list[str | None]] = {}

    def pick(
        self,
        replicas: Sequence[Replica],
        exclude: Collection[str],
        client_region: str | None,
        spill_when_waiting: int | None = None,
    ) -> RegionPick:
        """`replicas`: every replica of the chosen deployment, healthy or not (an outage is told apart
        from an overload by the ones that are down). `spill_when_waiting`: the model's
        `routing.spill_when_waiting` (None: only the capacity count says a region is full)."""
        usable = [replica for replica in replicas if replica.healthy and replica.id not in exclude]
        if client_region is None or client_region not in self._known:
            free = [replica for replica in usable if replica.has_capacity]
            return RegionPick(free, None, "any-region" if free else "saturated")
        by_region: dict[str | None, list[Replica]] = {}
        for replica in replicas:
            by_region.setdefault(replica.region, [])
        for replica in usable:
            by_region[replica.region].append(replica)
        first_skip: str | None = None
        nearest_overloaded: RegionPick | None = None  # the nearest free region whose queues all build
        for region in self._nearest_first(client_region, tuple(by_region)):
            group = by_region[region]
            free = [replica for replica in group if replica.has_capacity]
            if free and spill_when_waiting is not None:
                relieved = [r for r in free if not r.queue_building(spill_when_waiting)]
                if not relieved:
                    nearest_overloaded = nearest_overloaded or RegionPick(free, region, "overloaded")
                free = relieved
            if free:
                if first_skip is not None:
                    reason = first_skip
                else:
                    reason = "local" if region == client_region else "nearest"
                return RegionPick(free, region, reason)
            if first_skip is None:
                first_skip = "spill-overload" if group else "spill-outage"
        return nearest_overloaded or RegionPick([], None, "saturated")

    def _nearest_first(self, client_region: str, regions: tuple[str | None, ...]) -> list[str | None]:
        key = (client_region, regions)
        order = self._order_cache.get(key)
        if order is None:

            def distance(region: str | None) -> tuple[float, int, str]:
                if region is None:  # replicas without a region: after every named one
                    return float("inf"), 1, ""
                return self._config.latency_ms(client_region, region), 0, region

            order = self._order_cache[key] = sorted(regions, key=distance)
        return order
