"""The simulator at scale: thousands of replicas in several regions over simulated days, in minutes.

Where `simulator.FleetSimulator` follows every request in 0.05 s ticks (right for tens of replicas),
this one is a fluid model: each region's replicas are one group, and every decision interval moves
the group's aggregate state (requests queued, requests running, replicas loading and ready) by the
arrivals and completions of that interval:

- arrivals: the trace's rate in that region times the interval, with seeded Poisson-like noise;
- a request takes one prefill (`ReplicaProfile`) plus its output tokens at the step time of the
  replica's current batch, so a group completes `running / service time` requests per second;
- the queue waits for free slots (`max_batch` per ready replica); requests a region's own slots do not
  take go where the gateway's region-aware router (`RegionSelector`, its own code, over one gateway
  `Replica` per region that holds the region's slots) sends them: the nearest region, by the fleet
  file's latencies, with a free slot; they pay that latency on their TTFT. A region the fleet file
  gives no latency from the home region is not used (the router would try it as a last resort, at
  a latency the file does not give);
- TTFT = latency + queue wait (queue / completion rate) + the wait for a prefill turn (M/D/1 at the
  replica's prefill utilisation, exponential tail) + the prefill; ITL = the step time at the batch.

Every interval each region asks its own policy object (the real `AutoscalingPolicy`, or the static
and Knative-style baselines below: anything with `decide(Observation) -> Decision`) with the same
`Observation` the live autoscaler builds; started replicas serve after the profile's cold start,
removed ones stop taking requests at once and are paid for while their batch drains. Deterministic
for a seed.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ember.control.autoscaling.policy import Decision, Observation, WindowLatency
from ember.control.autoscaling.replica_profile import ReplicaProfile
from ember.control.autoscaling.simulator import count_flaps
from ember.gateway.config import AutoscalingConfig, GatewayConfig
from ember.gateway.replicas import Replica
from ember.gateway.routing.region import RegionSelector

KNATIVE_TARGET_UTILISATION = 0.7  # Knative's container-concurrency-target-percentage default
TIMELINE_STEP_S = 60.0


class Policy(Protocol):
    def decide(self, obs: Observation) -> Decision: ...


class StaticPolicy:
    """A fixed fleet (sized for the peak)."""

    def __init__(self, replicas: int):
        self.replicas = replicas

    def decide(self, obs: Observation) -> Decision:
        return Decision(self.replicas, "static")


class KnativeStylePolicy:
    """Knative's KPA: replicas = concurrency averaged over the stable window / (70% of the slots); in
    panic (the panic window's average needs twice the ready replicas) it only scales up; a step down
    takes the largest count wanted over `scale_down_delay_s` (Knative's scale-down-delay)."""

    def __init__(self, config: AutoscalingConfig, interval_s: float):
        self.config = config
        self.samples: deque[float] = deque(maxlen=max(1, round(config.stable_window_s / interval_s)))
        self.panic_samples = max(1, round(config.panic_window_s / interval_s))
        self.wanted: deque[int] = deque(maxlen=max(1, round(config.scale_down_delay_s / interval_s)))
        self.panic_until = -math.inf

    def decide(self, obs: Observation) -> Decision:
        config = self.config
        self.samples.append(obs.in_flight + obs.queued)
        target = obs.capacity_per_replica * KNATIVE_TARGET_UTILISATION
        stable = math.ceil(sum(self.samples) / len(self.samples) / target)
        recent = list(self.samples)[-self.panic_samples :]
        panic = math.ceil(sum(recent) / len(recent) / target)
        current = obs.ready + obs.loading
        if not self.wanted:  # the delay holds the count it started with, as a running fleet's would
            self.wanted.append(current)
        if obs.ready and panic >= 2 * obs.ready:
            self.panic_until = obs.now + config.stable_window_s
        if obs.now < self.panic_until:
            desired, reason = max(current, panic), "panic"
        else:
            desired, reason = stable, "concurrency"
        self.wanted.append(desired)
        return Decision(min(max(max(self.wanted), config.min_replicas), config.max_replicas), reason)


@dataclass(frozen=True)
class Region:
    name: str
    share: float  # of the trace's load that starts in this region


@dataclass
class _Group:
    """One region's replicas, as aggregates."""

    policy: Policy
    ready: int
    loading: deque[tuple[float, int]] = field(default_factory=deque)  # (ready at, how many)
    queued: float = 0.0
    running: float = 0.0
    finished: float = 0.0
    finished_delta: float = 0.0  # in the last interval
    ttft: deque[tuple[float, float]] = field(default_factory=deque)  # (time, p90 of that interval)
    itl: deque[tuple[float, float]] = field(default_factory=deque)
    waits: deque[tuple[float, float]] = field(default_factory=deque)

    @property
    def loading_count(self) -> int:
        return sum(count for _, count in self.loading)


@dataclass(frozen=True)
class ScaleReport:
    requests: float
    slo_attainment: float  # share of requests within both objectives (estimated, see the module doc)
    replica_hours: float
    cost: float
    cost_per_million_tokens: float
    cold_starts: int
    scale_events: int
    flaps: int
    peak_replicas: int
    # One point per simulated minute: (time s, arrivals/s, replicas running, worst region's p90 TTFT s).
    timeline: list[tuple[float, float, int, float]]


def diurnal_rate(trough: float, peak: float, period_s: float = 86_400.0) -> Callable[[float], float]:
    swing = (peak - trough) / 2
    return lambda t: trough + swing * (1 - math.cos(2 * math.pi * t / period_s))


def bursty_rate(base: float, burst: float, on_s: float = 60.0, off_s: float = 240.0) -> Callable[[float], float]:
    return lambda t: burst if t % (on_s + off_s) >= off_s else base


class ScaleSimulator:
    def __init__(
        self,
        config: AutoscalingConfig,
        profile: ReplicaProfile,
        regions: Sequence[Region],
        fleet: GatewayConfig,  # its regions' latencies, for the router
        prompt_tokens: int = 256,
        output_tokens: int = 128,
        interval_s: float = 2.0,
    ):
        self.config = config
        self.profile = profile
        self.regions = list(regions)
        self.fleet = fleet
        self.router = RegionSelector(fleet)
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.interval_s = interval_s
        self.prefill_s = prompt_tokens / profile.prefill_tokens_per_s

    def service_s(self, batch: float) -> float:
        """How long one request holds a slot at this per-replica batch."""
        return self.prefill_s + (self.output_tokens - 1) * self.profile.step_s(max(1, round(batch)))

    def run(
        self, rate_at: Callable[[float], float], duration_s: float, policies: Sequence[Policy], seed: int = 0,
        initial_replicas: int | None = None,
    ) -> ScaleReport:  # fmt: skip
        """`policies`: one per region, in `regions` order."""
        config, profile, dt = self.config, self.profile, self.interval_s
        rng = random.Random(seed)
        start = config.min_replicas if initial_replicas is None else initial_replicas
        groups = [_Group(policy, ready=start) for policy in policies]
        price = profile.cost_per_replica_hour if profile.cost_per_replica_hour is not None else config.cost_per_replica_hour
        replica_seconds = within = arrived = tokens = 0.0
        cold_starts = peak = 0
        decisions: list[tuple[float, int, int, str]] = []
        timeline: list[tuple[float, float, int, float]] = []
        next_point = 0.0
        for tick in range(int(duration_s / dt)):
            now = tick * dt
            mean = rate_at(now) * dt
            worst_ttft = 0.0
            for region, group in zip(self.regions, groups, strict=True):
                while group.loading and group.loading[0][0] <= now:
                    group.ready += group.loading.popleft()[1]
                expected = mean * region.share
                group.queued += max(0.0, expected + math.sqrt(expected) * rng.gauss(0, 1)) if expected else 0.0
            spilled = self._spill_over(groups)
            for index, (region, group) in enumerate(zip(self.regions, groups, strict=True)):
                served, ok = self._advance(group, now, spilled[index])
                arrived += served
                within += ok
                tokens += group.finished_delta * self.output_tokens
                worst_ttft = max(worst_ttft, group.ttft[-1][1] if group.ttft and group.ttft[-1][0] == now else 0.0)
                current = group.ready + group.loading_count
                decision = group.policy.decide(self._observation(group, now))
                if decision.desired != current:
                    decisions.append((now, current, decision.desired, f"{region.name}: {decision.reason}"))
                replica_seconds += self._apply(group, decision.desired, current, now)
                cold_starts += max(decision.desired - current, 0)
            running = sum(group.ready + group.loading_count for group in groups)
            peak = max(peak, running)
            replica_seconds += running * dt
            if now >= next_point:
                next_point = now + TIMELINE_STEP_S
                timeline.append((now, rate_at(now), running, worst_ttft))
        cost = replica_seconds / 3600 * price
        return ScaleReport(
            requests=arrived,
            slo_attainment=within / arrived if arrived else 1.0,
            replica_hours=replica_seconds / 3600,
            cost=cost,
            cost_per_million_tokens=cost / tokens * 1e6 if tokens else 0.0,
            cold_starts=cold_starts,
            scale_events=len(decisions),
            flaps=count_flaps(decisions, config.stable_window_s),
            peak_replicas=peak,
            timeline=timeline,
        )

    def _spill_over(self, groups: list[_Group]) -> list[list[tuple[float, float]]]:
        """Queued requests that no slot at home takes go where the router sends them (the nearest
        region with a free slot). Returns, per region, the (requests, latency s) it received."""
        received: list[list[tuple[float, float]]] = [[] for _ in groups]
        free = [g.ready * self.profile.max_batch - g.running - g.queued for g in groups]  # < 0: queued
        slots = [
            Replica(
                id=region.name, url=f"sim://{region.name}", model="sim", upstream_model="sim", deployment="sim",
                version=None, weight=1.0, region=region.name, labels={}, capacity=group.ready * self.profile.max_batch,
            )
            for region, group in zip(self.regions, groups, strict=True)
        ]  # fmt: skip
        index = {region.name: number for number, region in enumerate(self.regions)}
        for home, group in enumerate(groups):
            excess = -free[home]
            unreachable = {r.name for r in self.regions if math.isinf(self._latency_s(home, index[r.name]))}
            while excess > 0:
                for slot, room in zip(slots, free, strict=True):  # whole free slots, as the router counts them
                    slot.outstanding = slot.capacity - math.floor(max(room, 0.0))
                pick = self.router.pick(slots, unreachable, self.regions[home].name)
                if not pick.candidates:
                    break
                other = index[pick.candidates[0].id]
                moved = min(excess, free[other])
                free[other] -= moved
                free[home] += moved
                excess -= moved
                group.queued -= moved
                received[other].append((moved, self._latency_s(home, other)))
        return received

    def _latency_s(self, source: int, target: int) -> float:
        return self.fleet.latency_ms(self.regions[source].name, self.regions[target].name) / 1000

    def _advance(self, group: _Group, now: float, received: list[tuple[float, float]]) -> tuple[float, float]:
        """One interval of one region; returns (requests that got their first token, those within the SLO)."""
        config, profile, dt = self.config, self.profile, self.interval_s
        slots = group.ready * profile.max_batch
        admitted_local = min(group.queued, max(0.0, slots - group.running))
        group.queued -= admitted_local
        admitted = [(admitted_local, 0.0), *received]
        inflow = sum(count for count, _ in admitted)
        batch = (group.running + inflow) / group.ready if group.ready else 0.0
        service_s = self.service_s(batch)
        # dR/dt = inflow rate - R / service time, solved exactly over the interval (a plain Euler step
        # at intervals near the service time would finish requests several times too early).
        decay = math.exp(-dt / service_s)
        running = group.running * decay + inflow / dt * service_s * (1 - decay)
        done = group.running + inflow - running
        group.running = running
        completion_rate = running / service_s
        group.finished += done
        group.finished_delta = done
        # Queue wait of what is queued now: until the completions ahead of it free slots. With nothing
        # completing (no ready replica) it is at least the TTFT objective: held requests count as misses.
        wait_s = group.queued / completion_rate if completion_rate else (config.ttft_p90_ms / 1000 if group.queued else 0.0)
        per_replica_rate = inflow / dt / group.ready if group.ready else 0.0
        utilisation = min(per_replica_rate * self.prefill_s, 0.99)
        prefill_wait_mean = utilisation / (2 * (1 - utilisation)) * self.prefill_s
        itl_s = profile.step_s(max(1, round(batch)))
        objective_s = config.ttft_p90_ms / 1000
        served = ok = 0.0
        for count, latency in admitted:
            served += count
            if itl_s * 1000 > config.itl_p90_ms:
                continue
            slack = objective_s - latency - wait_s - self.prefill_s
            if slack > 0:
                ok += count * (1 - math.exp(-slack / prefill_wait_mean) if prefill_wait_mean > 0 else 1.0)
        ttft_p90 = wait_s + self.prefill_s + 2.3 * prefill_wait_mean + max((lat for c, lat in admitted if c), default=0)
        for samples, value in ((group.ttft, ttft_p90), (group.itl, itl_s), (group.waits, wait_s)):
            if served or value:
                samples.append((now, value))
            while samples and samples[0][0] < now - config.stable_window_s:
                samples.popleft()
        return served, ok

    def _observation(self, group: _Group, now: float) -> Observation:
        config = self.config
        return Observation(
            now=now,
            ready=group.ready,
            loading=group.loading_count,
            queued=math.ceil(group.queued - 1e-9),
            in_flight=math.ceil(group.running - 1e-9),
            requests_total=group.finished,
            capacity_per_replica=self.profile.max_batch,
            stable=_window(now - config.stable_window_s, group),
            panic=_window(now - config.panic_window_s, group),
        )

    def _apply(self, group: _Group, desired: int, current: int, now: float) -> float:
        """Starts or removes replicas; returns the replica-seconds removed replicas spend draining."""
        if desired > current:
            group.loading.append((now + self.profile.cold_start_s, desired - current))
            return 0.0
        remove = current - desired
        while remove and group.loading:  # loading replicas go first, the newest first
            ready_at, count = group.loading.pop()
            taken = min(count, remove)
            remove -= taken
            if count > taken:
                group.loading.append((ready_at, count - taken))
        if not remove:
            return 0.0
        batch = group.running / group.ready if group.ready else 0.0
        group.ready -= remove
        # Their requests finish where they run (draining): half a service time each on average.
        return remove * (self.service_s(batch) / 2 if batch else 0.0)


def _p90(samples: deque[tuple[float, float]], since: float) -> float | None:
    values = sorted(value for at, value in samples if at >= since)
    return values[min(int(0.9 * len(values)), len(values) - 1)] if values else None


def _window(since: float, group: _Group) -> WindowLatency:
    return WindowLatency(
        ttft_p90_s=_p90(group.ttft, since), itl_p90_s=_p90(group.itl, since), queue_wait_p90_s=_p90(group.waits, since)
    )


def policies_for(
    name: str, config: AutoscalingConfig, profile: ReplicaProfile, regions: int, interval_s: float, static: int = 0
) -> list[Policy]:
    """One policy object per region: `ember` (AutoscalingPolicy, with the replicas' profile as the live
    loop has it), `knative` or `static` (`static` each)."""
    from ember.control.autoscaling.policy import AutoscalingPolicy

    if name == "ember":
        return [AutoscalingPolicy(config, profile) for _ in range(regions)]
    if name == "knative":
        return [KnativeStylePolicy(config, interval_s) for _ in range(regions)]
    return [StaticPolicy(static) for _ in range(regions)]


def plot_timeline(reports: dict[str, ScaleReport], path: str) -> None:
    """Load, replicas and the worst region's p90 TTFT over time, one line per policy (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (load, replicas, ttft) = plt.subplots(3, 1, sharex=True, figsize=(10, 8))
    first = next(iter(reports.values()))
    load.plot([p[0] / 3600 for p in first.timeline], [p[1] for p in first.timeline], color="black")
    load.set_ylabel("arrivals/s")
    for name, report in reports.items():
        hours = [p[0] / 3600 for p in report.timeline]
        replicas.plot(hours, [p[2] for p in report.timeline], label=name)
        ttft.plot(hours, [p[3] for p in report.timeline], label=name)
    replicas.set_ylabel("replicas")
    ttft.set_ylabel("p90 TTFT (s), worst region")
    ttft.set_yscale("log")
    ttft.set_xlabel("simulated hours")
    replicas.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
