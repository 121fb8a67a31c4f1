"""What the autoscaler reads, from Prometheus text: samples, and p90s over sliding windows of
cumulative histograms (the gateway's TTFT and queue wait, the replicas' inter-token latency).

A window's p90 comes from the difference between the histogram now and its last snapshot at or
before the window's start (zero when the counters began inside the window: a process that started
then), interpolated within the bucket as Prometheus' histogram_quantile does.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_samples(text: str) -> list[Sample]:
    return [
        Sample(sample.name, sample.labels, float(sample.value))
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def total(samples: Iterable[Sample], name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels` (0 when there are none)."""
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


def buckets(samples: Iterable[Sample], histogram: str, **labels: str) -> dict[float, float]:
    """Upper bound -> cumulative count of one histogram, summed over the samples matching `labels`."""
    counts: dict[float, float] = {}
    for s in samples:
        if s.name == histogram + "_bucket" and labels.items() <= s.labels.items():
            bound = float(s.labels["le"])
            counts[bound] = counts.get(bound, 0.0) + s.value
    return counts


def quantile(q: float, counts: dict[float, float]) -> float | None:
    """The q-quantile of a cumulative histogram; None when it holds no observation."""
    bounds = sorted(counts)
    if not bounds or counts[bounds[-1]] <= 0:
        return None
    rank = q * counts[bounds[-1]]
    cumulative = [counts[bound] for bound in bounds]
    index = bisect.bisect_left(cumulative, rank)
    upper = bounds[index]
    lower = bounds[index - 1] if index > 0 else 0.0
    if math.isinf(upper):  # above the largest finite bucket: that bound is all that is known
        return lower
    below = cumulative[index - 1] if index > 0 else 0.0
    within = cumulative[index] - below
    return upper if within <= 0 else lower + (upper - lower) * (rank - below) / within


class HistogramWindow:
    """Snapshots of one cumulative histogram, kept for `horizon_s`, to read p90s over windows."""

    def __init__(self, horizon_s: float):
        self.horizon_s = horizon_s
        self._snapshots: deque[tuple[float, dict[float, float]]] = deque()

    def record(self, now: float, counts: dict[float, float]) -> None:
        self._snapshots.append((now, counts))
        # Keep one snapshot at or before the horizon: the baseline of the longest window.
        while len(self._snapshots) > 1 and self._snapshots[1][0] <= now - self.horizon_s:
            self._snapshots.popleft()

    def delta(self, now: float, window_s: float) -> dict[float, float]:
        """Observations within the last `window_s`, as a cumulative histogram."""
        if not self._snapshots:
            return {}
        current = self._snapshots[-1][1]
        baseline: dict[float, float] = {}
        for at, counts in reversed(self._snapshots):
            if at <= now - window_s:
                baseline = counts
                break
        if any(current.get(bound, 0.0) < count for bound, count in baseline.items()):
            baseline = {}  # the counters were reset (a restarted process): everything is new
        return {bound: count - baseline.get(bound, 0.0) for bound, count in current.items()}

    def p90(self, now: float, window_s: float) -> float | None:
        return quantile(0.9, self.delta(now, window_s))


def merged_p90(windows: Iterable[HistogramWindow], now: float, window_s: float) -> float | None:
    """The p90 of several processes' histograms (the replicas of a model) over one window."""
    merged: dict[float, float] = {}
    for window in windows:
        for bound, count in window.delta(now, window_s).items():
            merged[bound] = merged.get(bound, 0.0) + count
    return quantile(0.9, merged)
