"""The last hour of the gateway's traffic, in memory, for the web console's charts.

Prometheus stays the long-term store; this keeps 5-second buckets for an hour so that `/console`
can draw charts without one. GatewayMetrics feeds it at the points where it records its own
metrics (see GatewayMetrics.observe_*), so both always count the same events.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

BUCKET_S = 5.0
WINDOW_S = 3600.0
# Latency samples kept per bucket and kind: bounds memory at high request rates; the percentiles of
# a bucket are then those of its first MAX_SAMPLES requests.
MAX_SAMPLES = 2000


def percentile(sorted_values: list[float], fraction: float) -> float | None:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_values:
        return None
    rank = max(math.ceil(fraction * len(sorted_values)) - 1, 0)
    return sorted_values[rank]


class _Bucket:
    __slots__ = ("start", "statuses", "ttft", "itl", "queue_wait", "output_tokens", "queue_depth", "healthy_replicas")

    def __init__(self, start: float, healthy_replicas: int):
        self.start = start
        self.statuses: Counter[str] = Counter()
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.queue_wait: list[float] = []
        self.output_tokens = 0
        self.queue_depth = 0  # the deepest any model's queue was during the bucket
        self.healthy_replicas = healthy_replicas  # sampled as the bucket opens, for its cost


def _add_sample(samples: list[float], value: float) -> None:
    if len(samples) < MAX_SAMPLES:
        samples.append(value)


class ConsoleSeries:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.buckets: deque[_Bucket] = deque(maxlen=int(WINDOW_S / BUCKET_S))
        self.healthy_replicas: Callable[[], int] = lambda: 0  # GatewayMetrics.watch_pool sets the pool's count

    def _current(self) -> _Bucket:
        start = self.clock() // BUCKET_S * BUCKET_S
        if not self.buckets or self.buckets[-1].start != start:
            self.buckets.append(_Bucket(start, self.healthy_replicas()))
        return self.buckets[-1]

    def request(self, status: str) -> None:
        self._current().statuses[status] += 1

    def ttft(self, seconds: float) -> None:
        _add_sample(self._current().ttft, seconds)

    def completion(self, output_tokens: int, itl_seconds: float | None) -> None:
        bucket = self._current()
        bucket.output_tokens += output_tokens
        if itl_seconds is not None:
            _add_sample(bucket.itl, itl_seconds)

    def queue(self, depth: int) -> None:
        bucket = self._current()
        bucket.queue_depth = max(bucket.queue_depth, depth)

    def queue_wait(self, seconds: float) -> None:
        _add_sample(self._current().queue_wait, seconds)

    def to_json(self, since_s: float, replica_price_per_hour: float | None) -> dict[str, Any]:
        """Buckets of the last `since_s` seconds, oldest first; empty buckets are left out."""
        oldest = self.clock() - since_s
        points = [self._point(b, replica_price_per_hour) for b in self.buckets if b.start >= oldest]
        return {"object": "console.series", "bucket_s": BUCKET_S, "points": points}

    @staticmethod
    def _point(bucket: _Bucket, price_per_hour: float | None) -> dict[str, Any]:
        def quantiles(samples: list[float]) -> dict[str, float | None]:
            ordered = sorted(samples)
            return {name: percentile(ordered, q) for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}

        cost = None
        if price_per_hour is not None and bucket.output_tokens:
            fleet_cost = price_per_hour * bucket.healthy_replicas * BUCKET_S / 3600
            cost = fleet_cost / bucket.output_tokens * 1_000_000
        return {
            "t": bucket.start,
            "requests_per_s": {status: count / BUCKET_S for status, count in sorted(bucket.statuses.items())},
            "ttft_s": quantiles(bucket.ttft),
            "itl_s": quantiles(bucket.itl),
            "output_tokens_per_s": bucket.output_tokens / BUCKET_S,
            "queue_depth": bucket.queue_depth,
            "queue_wait_s": quantiles(bucket.queue_wait),
            "cost_per_1m_output_tokens": cost,
        }
