"""The scaling policy: one model's observed load in, a desired replica count and its reason out.

Pure and deterministic (no clock, no I/O): `ember up`'s autoscaler feeds it live observations every
interval, tests and simulations feed it scripted ones, and the same inputs always give the same
decisions. The rules, in order:

1. `min_replicas`: never fewer ready-or-loading replicas than the minimum.
2. activate: requests held for a model with no ready replica start one at once (scale from zero).
3. panic: a p90 in the short panic window at PANIC_RATIO times its objective, or more requests
   queued than all ready replicas have slots, scales up at once; panic only ever scales up, and it
   blocks scaling down for one stable window after it ends.
4. SLO breach: a p90 above its objective in the stable window, still above it in the panic window
   (so the stale tail of a breach that new replicas already fixed does not add more), lasting
   `scale_up_delay_s`; or requests waiting at the gateway for a free slot.
   Up-sizing is proportional: ready replicas x the (current) observed/objective ratio.
5. scale down, one replica at a time, only when one replica fewer would still meet every objective
   at the current load (p90s scaled by N/(N-1) stay under SCALE_DOWN_HEADROOM of the objective,
   and the in-flight requests and KV cache fit), continuously for `scale_down_delay_s`. This is
   what keeps a load that one replica almost serves from flapping 2 <-> 1. With the replicas'
   profile (`ember profile`), N-1 must also pass a capacity check by its step-time model, as llm-d
   simulates N-1 before scaling down: the current completion rate stays under the headroom of what
   N-1 replicas complete at full batch, and their step time at the projected batch under the
   headroom of the ITL objective. Free slots alone overstate what is left: a batch twice as big
   steps slower, so it does not complete twice as many requests.
6. scale to zero (min_replicas 0): no request arrived, ran or waited for `scale_to_zero_after_s`.

Replicas still loading are never capacity: ratios are taken over ready replicas only. They do
count as already started, so a breach waiting for them to load does not start more. Latencies
observed across a change in the ready count describe the old capacity (requests held through a cold
start report the cold start as their TTFT, a little after the change): for two panic windows after
the change (one for those requests to get their first tokens, one for the window to forget them)
only the queue rules scale up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ember.control.autoscaling.replica_profile import ReplicaProfile
from ember.gateway.config import AutoscalingConfig

PANIC_RATIO = 2.0
SCALE_DOWN_HEADROOM = 0.8  # one replica fewer must keep p90s, slots and KV under 80% of their limits


@dataclass(frozen=True)
class WindowLatency:
    """p90s in seconds over one window; None where nothing was observed in it."""

    ttft_p90_s: float | None = None
    itl_p90_s: float | None = None
    queue_wait_p90_s: float | None = None


@dataclass(frozen=True)
class ReplicaLoad:
    """One ready replica's own /metrics."""

    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0  # 0..1
    tokens_per_s: float = 0.0


@dataclass(frozen=True)
class Observation:
    now: float  # seconds on any monotonic clock
    ready: int  # replicas the gateway routes to
    loading: int  # started, not yet admitted by the gateway
    queued: int  # requests held in the gateway's queue for this model
    in_flight: int  # requests the gateway has on this model's replicas
    requests_total: float  # requests the gateway has finished for this model (a counter: arrivals show in it)
    capacity_per_replica: int  # concurrent requests the gateway sends one replica
    stable: WindowLatency = field(default_factory=WindowLatency)
    panic: WindowLatency = field(default_factory=WindowLatency)
    replicas: tuple[ReplicaLoad, ...] = ()


def observation_from_dict(data: dict) -> Observation:
    """The inverse of dataclasses.asdict(observation), for replaying a recorded run (JSON)."""
    return Observation(
        **{
            **data,
            "stable": WindowLatency(**data["stable"]),
            "panic": WindowLatency(**data["panic"]),
            "replicas": tuple(ReplicaLoad(**replica) for replica in data["replicas"]),
        }
    )


@dataclass(frozen=True)
class Decision:
    desired: int
    reason: str  # min_replicas | activate | panic | slo_ttft | slo_itl | slo_queue_wait | queue |
    #              scale_down | scale_to_zero | hold
    detail: str = ""  # the numbers behind it, for the decision log


class AutoscalingPolicy:
    """One model's policy; keeps the timers its delays need between calls of `decide`. `profile`: how
    fast one replica is (its step-time model projects N-1 before a scale down), if measured."""

    def __init__(self, config: AutoscalingConfig, profile: ReplicaProfile | None = None):
        self.config = config
        self.profile = profile
        self._breach_since: float | None = None
        self._scale_down_ok_since: float | None = None
        self._panic_until = -math.inf
        self._last_activity: float | None = None
        self._last_requests_total: float | None = None
        self._last_ready: int | None = None
        self._ready_changed_at = -math.inf

    def decide(self, obs: Observation) -> Decision:
        decision = self._decide(obs)
        config = self.config
        if decision.desired > config.max_replicas:
            detail = f"{decision.detail}; wanted {decision.desired}, capped at max_replicas"
            return Decision(config.max_replicas, decision.reason, detail)
        return decision

    def _decide(self, obs: Observation) -> Decision:
        config = self.config
        current = obs.ready + obs.loading
        busy = obs.queued > 0 or obs.in_flight > 0 or obs.requests_total != self._last_requests_total
        if busy or self._last_activity is None:
            self._last_activity = obs.now
        self._last_requests_total = obs.requests_total
        concurrency = obs.in_flight + obs.queued
        slots_needed = math.ceil(concurrency / obs.capacity_per_replica)
        if self._last_ready is not None and obs.ready != self._last_ready:
            self._ready_changed_at = obs.now
        self._last_ready = obs.ready
        latencies_current = obs.now - self._ready_changed_at >= 2 * config.panic_window_s

        if current < config.min_replicas:
            return Decision(config.min_replicas, "min_replicas", f"{current} running")
        if obs.ready == 0 and concurrency > 0:
            return Decision(max(current, 1), "activate", f"{obs.queued} held, {obs.loading} loading")
        if obs.ready == 0:  # nothing serves and nothing waits: latencies left in the windows are stale
            return Decision(current, "hold")

        panic_ratio, panic_worst = self._worst_ratio(obs.panic) if latencies_current else (0.0, "none")
        # A queue as long as every ready slot, some of it waiting for one: held requests that the free slots
        # take at once (just after a replica's admission) are about to be dispatched, not an overflow.
        slots = obs.ready * obs.capacity_per_replica
        queue_overflows = obs.ready > 0 and obs.queued >= slots and obs.queued + obs.in_flight > slots
        if panic_ratio >= PANIC_RATIO or queue_overflows:
            self._panic_until = obs.now + config.stable_window_s
            self._scale_down_ok_since = None
            target = max(_replicas_for(obs.ready, panic_ratio), slots_needed, obs.ready + 1)
            why = f"{panic_worst} at {panic_ratio:.2f}x" if panic_ratio >= PANIC_RATIO else f"{obs.queued} queued"
            return Decision(max(current, target), "panic", f"{why} on {obs.ready} ready")

        stable_ratio, stable_worst = self._worst_ratio(obs.stable)  # scale down weighs it even when stale
        breach_ratio = min(stable_ratio, panic_ratio)
        if breach_ratio > 1.0 or slots_needed > obs.ready:
            self._scale_down_ok_since = None
            if self._breach_since is None:
                self._breach_since = obs.now
            if obs.now - self._breach_since < config.scale_up_delay_s:
                return Decision(current, "hold", f"breach for {obs.now - self._breach_since:.1f}s")
            target = max(_replicas_for(obs.ready, breach_ratio), slots_needed, obs.ready + 1)
            reason = f"slo_{stable_worst}" if breach_ratio > 1.0 else "queue"
            return Decision(max(current, target), reason, f"{breach_ratio:.2f}x objective, {concurrency} in flight+queued")
        self._breach_since = None

        if obs.now - self._last_activity >= config.scale_to_zero_after_s and config.min_replicas == 0 and current > 0:
            return Decision(0, "scale_to_zero", f"idle {obs.now - self._last_activity:.0f}s")
        return self._maybe_scale_down(obs, current, stable_ratio, concurrency)

    def _maybe_scale_down(self, obs: Observation, current: int, stable_ratio: float, concurrency: int) -> Decision:
        config = self.config
        fewer = obs.ready - 1
        if obs.loading or obs.queued or obs.now < self._panic_until or fewer < max(config.min_replicas, 1):
            self._scale_down_ok_since = None
            return Decision(current, "hold")
        projected_ratio = stable_ratio * obs.ready / fewer
        projected_slots = concurrency / (fewer * obs.capacity_per_replica)
        projected_kv = sum(replica.kv_usage for replica in obs.replicas) / fewer
        profiled_slots, profiled_itl = self._profiled_projection(obs, fewer)
        projected_slots = max(projected_slots, profiled_slots)
        projected_ratio = max(projected_ratio, profiled_itl)
        if max(projected_ratio, projected_slots, projected_kv) > SCALE_DOWN_HEADROOM:
            self._scale_down_ok_since = None
            return Decision(
                current, "hold",
                f"{fewer} would be at {projected_ratio:.2f}x objective, {projected_slots:.0%} slots, {projected_kv:.0%} KV",
            )  # fmt: skip
        if self._scale_down_ok_since is None:
            self._scale_down_ok_since = obs.now
        if obs.now - self._scale_down_ok_since < config.scale_down_delay_s:
            return Decision(current, "hold", f"{fewer} would suffice for {obs.now - self._scale_down_ok_since:.1f}s")
        self._scale_down_ok_since = None  # the next step down waits a full delay again
        return Decision(fewer, "scale_down", f"{fewer} at {projected_ratio:.2f}x objective")

    def _profiled_projection(self, obs: Observation, replicas: int) -> tuple[float, float]:
        """By the profile's step-time model: (the current completion rate over what `replicas` replicas
        complete at full batch, their ITL over its objective); (0, 0) without a profile.

        A request's time in a replica is in flight / completion rate (Little's law); at full batch it
        is that times step(max_batch) / step(current batch), decode being most of it (scaling its
        prefill part too only errs on the safe side). `replicas` complete max_batch requests per such
        time, so the share is in_flight * step(max_batch) / step(batch) / (replicas * max_batch): the
        rate cancels out. A replica whose steps slow in proportion to its batch gains no throughput
        from batching, and the share says so."""
        if self.profile is None or not obs.in_flight or not obs.ready:
            return 0.0, 0.0
        profile = self.profile
        step_now_s = profile.step_s(max(1, round(obs.in_flight / obs.ready)))
        in_flight_at_full_batch = obs.in_flight * profile.step_s(profile.max_batch) / step_now_s
        batch = min(profile.max_batch, math.ceil(in_flight_at_full_batch / replicas))
        share = in_flight_at_full_batch / (replicas * profile.max_batch)
        return share, profile.step_s(batch) * 1000 / self.config.itl_p90_ms

    def _worst_ratio(self, window: WindowLatency) -> tuple[float, str]:
        """The largest observed/objective ratio in a window (0 without observations) and its name."""
        config = self.config
        ratios = [(0.0, "none")]
        if window.ttft_p90_s is not None:
            ratios.append((window.ttft_p90_s * 1000 / config.ttft_p90_ms, "ttft"))
        if window.itl_p90_s is not None:
            ratios.append((window.itl_p90_s * 1000 / config.itl_p90_ms, "itl"))
        if window.queue_wait_p90_s is not None and config.queue_wait_p90_ms is not None:
            ratios.append((window.queue_wait_p90_s * 1000 / config.queue_wait_p90_ms, "queue_wait"))
        return max(ratios)


def _replicas_for(ready: int, ratio: float) -> int:
    """Replicas that bring `ratio` x objective on `ready` replicas down to the objective (linear model);
    a ratio a rounding error above a whole number does not cost a replica more."""
    return math.ceil(ready * ratio - 1e-9)
