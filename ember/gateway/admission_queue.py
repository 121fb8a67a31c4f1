"""Who waits: a per-model priority queue in front of replicas that are at capacity.

Higher tiers go first, FCFS within a tier. A request that finds the queue non-empty queues behind
it even if a slot is free at that instant, so late arrivals never overtake. Freed capacity (a
request finishing, a replica re-admitted) wakes as many waiters, in order, as there are free slots.
A waiter the router cannot serve when woken (a failover retry that excludes the free replica)
passes the slot on to the next in line. A waiter leaves at its deadline (408), when the queue is
full on arrival (429), or at once when its task is cancelled (the client disconnected).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ember.gateway.errors import GatewayError
from ember.gateway.metrics import GatewayMetrics
from ember.gateway.replicas import PoolEvent, Replica, ReplicaPool


@dataclass(slots=True)
class _Waiter:
    sort_key: tuple[int, int]  # (-priority, arrival sequence)
    future: asyncio.Future = field(compare=False)
    woken: bool = False
    # Woken, but the router found nothing for it (its failover excludes the free replicas, or its
    # canary deployment is full): skipped by wake-ups until the pool changes again.
    passed: bool = False

    def __lt__(self, other: _Waiter) -> bool:
        return self.sort_key < other.sort_key


class AdmissionQueue:
    def __init__(self, pool: ReplicaPool, max_size: int, metrics: GatewayMetrics):
        self.pool = pool
        self.max_size = max_size
        self.metrics = metrics
        self._waiters: dict[str, list[_Waiter]] = {}
        self._sequence = itertools.count()
        pool.add_listener(self._on_pool_event)

    def depth(self, model: str) -> int:
        return len(self._waiters.get(model, ()))

    async def acquire(
        self,
        model: str,
        priority: int,
        deadline: float,
        select: Callable[[], Replica | None],
        max_size: int | None = None,
    ) -> Replica:
        """A replica with a free slot, already acquired in the pool. `deadline` is time.monotonic();
        `max_size` replaces the queue's own limit for this arrival (the hold limit of a model that
        is scaling from zero)."""
        waiters = self._waiters.setdefault(model, [])
        if not waiters:
            replica = select()
            if replica is not None:
                self.pool.acquire(replica)
                return replica
        limit = self.max_size if max_size is None else max_size
        if len(waiters) >= limit:
            raise GatewayError(
                429,
                f"The queue for model {model!r} is full ({limit} waiting requests); retry later.",
                "requests",
                "queue_full",
                headers={"retry-after": "1"},
            )
        loop = asyncio.get_running_loop()
        waiter = _Waiter((-priority, next(self._sequence)), loop.create_future())
        bisect.insort(waiters, waiter)
        queued_at = time.monotonic()
        self.metrics.set_queue_depth(model, len(waiters))
        self._wake(model)  # a slot that waiters ahead passed on may suit this one
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._deadline_error(model, queued_at)
                try:
                    await asyncio.wait_for(waiter.future, remaining)
                except TimeoutError:
                    raise self._deadline_error(model, queued_at) from None
                replica = select()
                if replica is not None:
                    self.pool.acquire(replica)
                    return replica
                waiter.woken = False
                waiter.passed = True
                waiter.future = loop.create_future()
                self._wake(model)  # hand the slot to the next in line
        finally:
            waiters.remove(waiter)
            self.metrics.set_queue_depth(model, len(waiters))
            self.metrics.observe_queue_wait(model, time.monotonic() - queued_at)
            # Slots still free (one this waiter was handed but did not use because its deadline or a
            # disconnect raced the wake-up, or several freed at once) go to the next in line.
            self._wake(model)

    def _deadline_error(self, model: str, queued_at: float) -> GatewayError:
        waited_ms = round((time.monotonic() - queued_at) * 1000)
        return GatewayError(
            408,
            f"The request waited {waited_ms} ms in the queue for model {model!r} and passed its deadline "
            "before a replica had capacity.",
            "timeout_error",
            "deadline_exceeded",
        )

    def _on_pool_event(self, event: PoolEvent, replica: Replica) -> None:
        waiters = self._waiters.get(replica.model)
        if event != "eject" and waiters:
            for waiter in waiters:
                waiter.passed = False
            self._wake(replica.model)

    def _wake(self, model: str) -> None:
        waiters = self._waiters.get(model)
        if not waiters:
            return
        free = sum(replica.free_slots for replica in self.pool.replicas(model))
        free -= sum(1 for waiter in waiters if waiter.woken)
        for waiter in waiters:
            if free <= 0:
                break
            if not waiter.woken and not waiter.passed and not waiter.future.done():
                waiter.woken = True
                waiter.future.set_result(None)
                free -= 1
