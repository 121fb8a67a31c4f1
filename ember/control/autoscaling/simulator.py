"""A fleet simulator: replays arrivals through the real `AutoscalingPolicy` over simulated replicas.

First slice (issue 13): one model, one region, time in fixed ticks. Requests go to replicas by the
gateway's own default policy (`LeastOutstandingPolicy`, seeded), over a gateway `Replica` per
simulated replica that carries its requests in flight and its capacity (`max_batch`). A
replica's speed is a `ReplicaProfile` (prefill throughput, decode step time by batch size, cold
start), the numbers `ember profile` is meant to measure. Every `interval_s` the simulator builds the
same `Observation` the live autoscaler builds (queue, in flight, p90 TTFT / ITL / queue wait over
the policy's stable and panic windows) and applies the decision: new replicas serve after the cold
start, removed ones take no new request and stop once empty. Deterministic for a seed.
"""

from __future__ import annotations

import json
import math
import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from ember.control.autoscaling.policy import AutoscalingPolicy, Decision, Observation, WindowLatency
from ember.control.autoscaling.replica_profile import ReplicaProfile
from ember.errors import EmberError
from ember.gateway.config import AutoscalingConfig
from ember.gateway.replicas import Replica
from ember.gateway.request_context import RequestContext
from ember.gateway.routing.least_outstanding import LeastOutstandingPolicy

ROUTER_SEED = 0  # the router's random choices (two of the replicas, ties): deterministic runs


@dataclass(frozen=True)
class Arrival:
    time_s: float
    prompt_tokens: int
    output_tokens: int


def poisson_arrivals(rate_at, duration_s: float, seed: int, prompt_tokens: int = 256, output_tokens: int = 64) -> list[Arrival]:
    """Arrivals of a Poisson process whose rate (requests/s) is `rate_at(t)`, by thinning."""
    rng = random.Random(seed)
    peak = max(rate_at(t) for t in range(int(duration_s) + 1))
    arrivals, now = [], 0.0
    while peak > 0:
        now += rng.expovariate(peak)
        if now >= duration_s:
            break
        if rng.random() * peak < rate_at(now):
            arrivals.append(Arrival(now, prompt_tokens, output_tokens))
    return arrivals


def bursty(base_rate: float, burst_rate: float, on_s: float, off_s: float, duration_s: float, seed: int) -> list[Arrival]:
    """`base_rate` requests/s, `burst_rate` during `on_s` after every `off_s` of base load."""
    return poisson_arrivals(lambda t: burst_rate if t % (on_s + off_s) >= off_s else base_rate, duration_s, seed)


def diurnal(trough_rate: float, peak_rate: float, period_s: float, duration_s: float, seed: int) -> list[Arrival]:
    """A sine between `trough_rate` and `peak_rate`, peaking mid-period."""
    swing = (peak_rate - trough_rate) / 2
    return poisson_arrivals(
        lambda t: trough_rate + swing * (1 - math.cos(2 * math.pi * t / period_s)), duration_s, seed
    )


def steady(rate: float, duration_s: float, seed: int) -> list[Arrival]:
    return poisson_arrivals(lambda t: rate, duration_s, seed)


def load_trace(path: str | Path) -> list[Arrival]:
    """A JSONL trace: one `{"time_s": 0.4, "prompt_tokens": 512, "output_tokens": 128}` per line."""
    arrivals = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            arrivals.append(Arrival(float(item["time_s"]), int(item["prompt_tokens"]), int(item["output_tokens"])))
        except (ValueError, KeyError, TypeError) as exc:
            raise EmberError(f"{path}:{number}: not a trace line ({type(exc).__name__}: {exc})") from None
    return arrivals


@dataclass
class _Request:
    arrival: Arrival
    prefill_left_s: float
    tokens_left: int
    first_token_s: float | None = None
    started_s: float | None = None  # left the queue
    step_times: float = 0.0  # sum of its decode steps, for its mean ITL


@dataclass
class _Replica:
    ready_at: float
    routing: Replica  # what the gateway's router sees of it: requests in flight, capacity
    running: list[_Request] = field(default_factory=list)
    draining: bool = False


def _routing_replica(number: int, capacity: int) -> Replica:
    return Replica(
        id=f"sim-{number}", url=f"sim://{number}", model="sim", upstream_model="sim", deployment="sim",
        version=None, weight=1.0, region=None, labels={}, capacity=capacity,
    )  # fmt: skip


@dataclass(frozen=True)
class SimulationReport:
    requests: int
    served: int
    slo_attainment: float  # share of all requests served within both the TTFT and ITL objectives
    replica_seconds: float
    cost: float
    cost_per_million_tokens: float
    cold_starts: int
    scale_events: int
    flaps: int  # a step down followed by a step up (or the reverse) within one stable window
    decisions: list[tuple[float, int, int, str]]  # (time, current, desired, reason) that changed the count


class FleetSimulator:
    def __init__(
        self, config: AutoscalingConfig, profile: ReplicaProfile, interval_s: float = 2.0, tick_s: float = 0.05
    ):
        self.config = config
        self.profile = profile
        self.interval_s = interval_s
        self.tick_s = tick_s
        self.policy = AutoscalingPolicy(config, profile)
        self._started = 0  # replicas started in this run, for their routing ids

    def run(self, arrivals: list[Arrival], duration_s: float) -> SimulationReport:
        profile, config = self.profile, self.config
        self._started = 0
        replicas = [self._new_replica(0.0) for _ in range(config.min_replicas)]
        router = LeastOutstandingPolicy(rng=random.Random(ROUTER_SEED))
        context = RequestContext(model="sim", endpoint="completions", body={}, key_id="sim", priority=0)
        queue: deque[_Request] = deque()
        pending = deque(sorted(arrivals, key=lambda a: a.time_s))
        done: list[_Request] = []
        ttfts: deque[tuple[float, float]] = deque()  # (time observed, value), for the windows
        itls: deque[tuple[float, float]] = deque()
        waits: deque[tuple[float, float]] = deque()
        finished = 0
        replica_seconds = 0.0
        cold_starts = 0
        decisions: list[tuple[float, int, int, str]] = []
        next_decision = 0.0
        ticks = int(duration_s / self.tick_s)
        for tick in range(ticks):
            now = tick * self.tick_s
            while pending and pending[0].time_s <= now:
                arrival = pending.popleft()
                queue.append(_Request(arrival, arrival.prompt_tokens / profile.prefill_tokens_per_s, arrival.output_tokens))
            serving = {r.routing.id: r for r in replicas if r.ready_at <= now and not r.draining}
            while queue:
                choice = router.choose([r.routing for r in serving.values() if r.routing.has_capacity], context)
                if choice is None:
                    break
                request = queue.popleft()
                request.started_s = now
                waits.append((now, now - request.arrival.time_s))
                replica = serving[choice.replica.id]
                replica.running.append(request)
                replica.routing.outstanding += 1
            for replica in replicas:
                finished += self._advance(replica, now, ttfts, itls, done)
            replica_seconds += len(replicas) * self.tick_s
            replicas = [r for r in replicas if not (r.draining and not r.running)]
            if now >= next_decision:
                next_decision = now + self.interval_s
                decision = self._decide(now, replicas, queue, finished, ttfts, itls, waits)
                current = len(replicas) - sum(r.draining for r in replicas)
                if decision.desired != current:
                    decisions.append((now, current, decision.desired, decision.reason))
                cold_starts += max(decision.desired - current, 0)
                self._apply(decision.desired, current, replicas, now)
        return self._report(len(arrivals), done, replica_seconds, cold_starts, decisions)

    def _advance(self, replica: _Replica, now: float, ttfts: deque, itls: deque, done: list[_Request]) -> int:
        """One tick of one replica: the oldest prompt prefills, the rest of the batch decodes."""
        if not replica.running:
            return 0
        budget = self.tick_s
        prefilling = next((r for r in replica.running if r.prefill_left_s > 0), None)
        if prefilling is not None:
            spent = min(prefilling.prefill_left_s, budget)
            prefilling.prefill_left_s -= spent
            budget -= spent
            if prefilling.prefill_left_s <= 0:
                prefilling.first_token_s = now + spent
                ttfts.append((now, prefilling.first_token_s - prefilling.arrival.time_s))
                prefilling.tokens_left -= 1
        decoding = [r for r in replica.running if r.prefill_left_s <= 0 and r.tokens_left > 0 and r is not prefilling]
        if decoding and budget > 0:
            step = self.profile.step_s(len(decoding))
            for request in decoding:
                produced = min(budget / step, request.tokens_left)
                request.tokens_left -= produced
                request.step_times += produced * step
            itls.append((now, step))
        finishing = [r for r in replica.running if r.prefill_left_s <= 0 and r.tokens_left <= 1e-9]
        for request in finishing:
            replica.running.remove(request)
            replica.routing.outstanding -= 1
            done.append(request)
        return len(finishing)

    def _decide(self, now, replicas, queue, finished, ttfts, itls, waits) -> Decision:
        config = self.config
        for samples in (ttfts, itls, waits):
            while samples and samples[0][0] < now - config.stable_window_s:
                samples.popleft()
        ready = [r for r in replicas if r.ready_at <= now and not r.draining]
        return self.policy.decide(
            Observation(
                now=now,
                ready=len(ready),
                loading=sum(1 for r in replicas if r.ready_at > now and not r.draining),
                queued=len(queue),
                in_flight=sum(len(r.running) for r in replicas),
                requests_total=finished,
                capacity_per_replica=self.profile.max_batch,
                stable=_window(now, config.stable_window_s, ttfts, itls, waits),
                panic=_window(now, config.panic_window_s, ttfts, itls, waits),
            )
        )

    def _apply(self, desired: int, current: int, replicas: list[_Replica], now: float) -> None:
        for _ in range(desired - current):
            replicas.append(self._new_replica(now + self.profile.cold_start_s))
        # Loading replicas go first (newest first), then the least busy, as the live autoscaler does.
        active = [r for r in replicas if not r.draining]
        victims = sorted(active, key=lambda r: (r.ready_at <= now, -r.ready_at if r.ready_at > now else len(r.running)))
        for replica in victims[: max(current - desired, 0)]:
            replica.draining = True

    def _new_replica(self, ready_at: float) -> _Replica:
        self._started += 1
        return _Replica(ready_at, _routing_replica(self._started, self.profile.max_batch))

    def _report(self, requests, done, replica_seconds, cold_starts, decisions) -> SimulationReport:
        config = self.config
        within = sum(
            1 for r in done
            if (r.first_token_s - r.arrival.time_s) * 1000 <= config.ttft_p90_ms
            and (r.step_times / max(r.arrival.output_tokens - 1, 1)) * 1000 <= config.itl_p90_ms
        )  # fmt: skip
        cost = replica_seconds / 3600 * config.cost_per_replica_hour
        tokens = sum(r.arrival.output_tokens for r in done)
        flaps = count_flaps(decisions, config.stable_window_s)
        return SimulationReport(
            requests=requests,
            served=len(done),
            slo_attainment=within / requests if requests else 1.0,  # unserved requests count as misses
            replica_seconds=replica_seconds,
            cost=cost,
            cost_per_million_tokens=cost / tokens * 1e6 if tokens else 0.0,
            cold_starts=cold_starts,
            scale_events=len(decisions),
            flaps=flaps,
            decisions=decisions,
        )


def count_flaps(decisions: list[tuple[float, int, int, str]], window_s: float) -> int:
    """Reversals: a step down followed by a step up (or the reverse) within `window_s`."""
    return sum(
        1 for (t1, c1, d1, _), (t2, c2, d2, _) in zip(decisions, decisions[1:], strict=False)
        if (d1 - c1) * (d2 - c2) < 0 and t2 - t1 <= window_s
    )  # fmt: skip


def _p90(samples: deque, since: float) -> float | None:
    values = sorted(value for at, value in samples if at >= since)
    return values[min(int(0.9 * len(values)), len(values) - 1)] if values else None


def _window(now: float, window_s: float, ttfts: deque, itls: deque, waits: deque) -> WindowLatency:
    since = now - window_s
    return WindowLatency(ttft_p90_s=_p90(ttfts, since), itl_p90_s=_p90(itls, since), queue_wait_p90_s=_p90(waits, since))
