"""The loop `ember up` runs for a fleet with autoscaled models.

Every `launch.autoscaler.interval_s` it reads the gateway's /metrics (queue depth, queue wait and
TTFT histograms, requests finished, requests in flight) and each ready replica's /metrics (waiting,
running, KV usage, generated tokens, inter-token latency), turns them into one `Observation` per
model (p90s over the model's stable and panic windows), asks the model's `AutoscalingPolicy`, and
has the provider start replicas, or drain and stop them (loading ones first, then the least busy).

It exports `ember_autoscaler_*` metrics and keeps a log of the last decisions; with
`launch.autoscaler.port` set both are served (GET /metrics, GET /status, which `ember fleet status`
prints).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

import httpx
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ember.control.autoscaling.policy import (
    AutoscalingPolicy,
    Decision,
    Observation,
    ReplicaLoad,
    WindowLatency,
)
from ember.control.autoscaling.provider import ManagedReplica, ReplicaProvider, ReplicaState
from ember.control.autoscaling.signals import (
    HistogramWindow,
    Sample,
    buckets,
    merged_p90,
    parse_samples,
    total,
)
from ember.control.fleet import AutoscaledModel, Fleet
from ember.gateway.periodic import PeriodicTask

DECISION_LOG_SIZE = 200
COLD_START_BUCKETS = (1, 2, 3, 5, 7.5, 10, 15, 20, 30, 45, 60, 120)
ITL_HISTOGRAM = "ember:inter_token_latency_seconds"


@dataclass(frozen=True)
class LoggedDecision:
    time: str  # UTC, ISO 8601
    model: str
    current: int  # ready + loading when it was taken
    desired: int
    reason: str
    detail: str


class AutoscalerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.desired = Gauge("ember_autoscaler_desired_replicas", "Replicas the policy wants", ["model"], registry=r)
        self.current = Gauge(
            "ember_autoscaler_current_replicas", "Replicas by state (loading, ready, draining)", ["model", "state"],
            registry=r,
        )  # fmt: skip
        self.decisions = Counter(
            "ember_autoscaler_decisions", "Decisions taken (one per model per interval), by reason", ["model", "reason"],
            registry=r,
        )  # fmt: skip
        self.scale_events = Counter(
            "ember_autoscaler_scale_events", "Decisions that changed the replica count", ["model", "direction"], registry=r
        )
        self.cold_start = Histogram(
            "ember_autoscaler_cold_start_seconds", "Replica process start to admission by the gateway", ["model"],
            buckets=COLD_START_BUCKETS, registry=r,
        )  # fmt: skip
        self.replica_seconds = Counter(
            "ember_autoscaler_replica_seconds", "Replica-seconds run (loading, ready or draining)", ["model"], registry=r
        )
        self.cost = Counter(
            "ember_autoscaler_cost", "Replica-seconds priced at autoscaling.cost_per_replica_hour", ["model"], registry=r
        )
        self.observed_p90 = Gauge(
            "ember_autoscaler_observed_p90_seconds", "The p90s the last decision saw", ["model", "signal", "window"],
            registry=r,
        )  # fmt: skip


class _ModelSignals:
    """Sliding windows of one model's histograms, and its replicas' token counters."""

    def __init__(self, horizon_s: float):
        self.ttft = HistogramWindow(horizon_s)
        self.queue_wait = HistogramWindow(horizon_s)
        self.itl: dict[str, HistogramWindow] = {}  # per replica
        self.generated: dict[str, tuple[float, float]] = {}  # replica -> (time, generation tokens total)
        self.horizon_s = horizon_s

    def window(self, now: float, window_s: float) -> WindowLatency:
        return WindowLatency(
            ttft_p90_s=self.ttft.p90(now, window_s),
            itl_p90_s=merged_p90(self.itl.values(), now, window_s),
            queue_wait_p90_s=self.queue_wait.p90(now, window_s),
        )


class Autoscaler:
    def __init__(
        self,
        fleet: Fleet,
        provider: ReplicaProvider,
        log: Callable[[str], None] = print,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.fleet = fleet
        self.provider = provider
        self.log = log
        self.clock = clock
        self.settings = fleet.launch.autoscaler
        self.models: dict[str, AutoscaledModel] = fleet.autoscaled
        self.policies = {name: AutoscalingPolicy(model.autoscaling) for name, model in self.models.items()}
        self.signals = {name: _ModelSignals(model.autoscaling.stable_window_s) for name, model in self.models.items()}
        self.metrics = AutoscalerMetrics()
        self.decision_log: deque[LoggedDecision] = deque(maxlen=DECISION_LOG_SIZE)
        self._last_reason: dict[str, str] = {}
        self._desired: dict[str, int] = {}
        self._last_step: float | None = None
        self._admitted: set[str] = set()  # replica ids whose cold start is recorded
        self._stops: set[asyncio.Task] = set()
        self._http = httpx.AsyncClient(timeout=max(1.0, self.settings.interval_s))
        self._task = PeriodicTask("ember-autoscaler", self.settings.interval_s, self.step)
        self._site: web.AppRunner | None = None

    # --- lifecycle (a Supervisor service) ---------------------------------------------------------

    async def start(self) -> None:
        if self.settings.port is not None:
            app = web.Application()
            app.router.add_get("/metrics", self._serve_metrics)
            app.router.add_get("/status", self._serve_status)
            self._site = web.AppRunner(app, access_log=None)
            await self._site.setup()
            await web.TCPSite(self._site, self.settings.host, self.settings.port).start()
        await self._task.start()

    async def stop(self) -> None:
        await self._task.stop()
        await asyncio.gather(*self._stops, return_exceptions=True)
        await self.provider.close()
        await self._http.aclose()
        if self._site is not None:
            await self._site.cleanup()

    # --- one round ------------------------------------------------------------------------------

    async def step(self) -> None:
        now = self.clock()
        elapsed = 0.0 if self._last_step is None else now - self._last_step
        self._last_step = now
        try:
            gateway = parse_samples((await self._http.get(self.fleet.gateway_url + "/metrics")).text)
        except (httpx.HTTPError, ValueError):
            return  # the gateway is starting or restarting: decide on the next round
        for name in self.models:
            await self._step_model(name, now, elapsed, gateway)

    async def _step_model(self, name: str, now: float, elapsed: float, gateway: list[Sample]) -> None:
        model = self.models[name]
        replicas = self.provider.list_replicas(name)
        by_state = {state: [r for r in replicas if r.state == state] for state in ReplicaState}
        ready, loading = by_state[ReplicaState.READY], by_state[ReplicaState.LOADING]
        self._account(name, model, by_state, elapsed)
        signals = self.signals[name]
        signals.ttft.record(now, buckets(gateway, "ember_gateway_time_to_first_token_seconds", model=name))
        signals.queue_wait.record(now, buckets(gateway, "ember_gateway_queue_wait_seconds", model=name))
        loads = await asyncio.gather(*(self._replica_load(signals, replica, now) for replica in ready))
        for gone in set(signals.itl) - {replica.id for replica in ready}:
            del signals.itl[gone]
            signals.generated.pop(gone, None)
        settings = model.autoscaling
        observation = Observation(
            now=now,
            ready=len(ready),
            loading=len(loading),
            queued=int(total(gateway, "ember_gateway_queue_depth", model=name)),
            in_flight=int(total(gateway, "ember_gateway_replica_outstanding", model=name)),
            requests_total=total(gateway, "ember_gateway_requests_total", model=name),
            capacity_per_replica=model.capacity,
            stable=signals.window(now, settings.stable_window_s),
            panic=signals.window(now, settings.panic_window_s),
            replicas=tuple(loads),
        )
        decision = self.policies[name].decide(observation)
        self._record(name, observation, decision)
        outstanding = {r.id: total(gateway, "ember_gateway_replica_outstanding", replica=r.id) for r in ready}
        await self._apply(name, decision, loading, sorted(ready, key=lambda r: outstanding[r.id]))

    async def _replica_load(self, signals: _ModelSignals, replica: ManagedReplica, now: float) -> ReplicaLoad:
        try:
            samples = parse_samples((await self._http.get(replica.url + "/metrics")).text)
        except (httpx.HTTPError, ValueError):
            return ReplicaLoad()
        window = signals.itl.setdefault(replica.id, HistogramWindow(signals.horizon_s))
        window.record(now, buckets(samples, ITL_HISTOGRAM))
        generated = total(samples, "ember:generation_tokens_total")
        previous = signals.generated.get(replica.id)
        signals.generated[replica.id] = (now, generated)
        rate = 0.0
        if previous is not None and now > previous[0] and generated >= previous[1]:
            rate = (generated - previous[1]) / (now - previous[0])
        return ReplicaLoad(
            waiting=total(samples, "ember:num_requests_waiting"),
            running=total(samples, "ember:num_requests_running"),
            kv_usage=total(samples, "ember:kv_cache_usage_perc"),
            tokens_per_s=rate,
        )

    async def _apply(
        self, name: str, decision: Decision, loading: list[ManagedReplica], ready_least_busy_first: list[ManagedReplica]
    ) -> None:
        current = len(loading) + len(ready_least_busy_first)
        for _ in range(decision.desired - current):
            replica = await self.provider.start_replica(name)
            self.log(f"autoscaler: {name}: started {replica.id} ({decision.reason})")
        if decision.desired >= current:
            return
        # Loading replicas serve nothing yet: they go first, the newest first; then the least busy.
        victims = sorted(loading, key=lambda r: -r.started_at) + ready_least_busy_first
        for replica in victims[: current - decision.desired]:
            self.log(f"autoscaler: {name}: draining and stopping {replica.id} ({decision.reason})")
            task = asyncio.create_task(self._stop(replica), name=f"stop-{replica.id}")
            self._stops.add(task)
            task.add_done_callback(self._stops.discard)
        await asyncio.sleep(0)  # let the stops mark their replicas draining before anything counts them

    async def _stop(self, replica: ManagedReplica) -> None:
        try:
            await self.provider.stop_replica(replica.id)
        except httpx.HTTPError as exc:
            self.log(f"autoscaler: stopping {replica.id}: the gateway did not answer the drain ({exc}); stopped anyway")
        else:
            self.log(f"autoscaler: {replica.model}: {replica.id} drained and stopped")

    # --- bookkeeping ------------------------------------------------------------------------------

    def _account(self, name: str, model: AutoscaledModel, by_state: dict, elapsed: float) -> None:
        for state, replicas in by_state.items():
            self.metrics.current.labels(name, state.value).set(len(replicas))
        running = sum(len(replicas) for replicas in by_state.values())
        self.metrics.replica_seconds.labels(name).inc(running * elapsed)
        self.metrics.cost.labels(name).inc(running * elapsed / 3600 * model.autoscaling.cost_per_replica_hour)
        for replica in by_state[ReplicaState.READY]:
            if replica.id not in self._admitted and replica.cold_start_s is not None:
                self._admitted.add(replica.id)
                self.metrics.cold_start.labels(name).observe(replica.cold_start_s)
        self._admitted &= {replica.id for replicas in by_state.values() for replica in replicas}

    def _record(self, name: str, observation: Observation, decision: Decision) -> None:
        current = observation.ready + observation.loading
        self._desired[name] = decision.desired
        self.metrics.desired.labels(name).set(decision.desired)
        self.metrics.decisions.labels(name, decision.reason).inc()
        for window_name, window in (("stable", observation.stable), ("panic", observation.panic)):
            for signal, value in (("ttft", window.ttft_p90_s), ("itl", window.itl_p90_s), ("queue_wait", window.queue_wait_p90_s)):
                self.metrics.observed_p90.labels(name, signal, window_name).set(value if value is not None else float("nan"))
        if decision.desired != current:
            self.metrics.scale_events.labels(name, "up" if decision.desired > current else "down").inc()
        if decision.desired != current or decision.reason != self._last_reason.get(name):
            self._last_reason[name] = decision.reason
            entry = LoggedDecision(
                datetime.now(UTC).isoformat(timespec="seconds"), name, current, decision.desired, decision.reason,
                decision.detail,
            )  # fmt: skip
            self.decision_log.append(entry)
            if decision.desired != current:
                self.log(f"autoscaler: {name}: {current} -> {decision.desired} ({decision.reason}: {decision.detail})")

    # --- the control endpoint ---------------------------------------------------------------------

    def status(self) -> dict:
        models = {}
        for name, model in self.models.items():
            replicas = self.provider.list_replicas(name)
            models[name] = {
                "min_replicas": model.autoscaling.min_replicas,
                "max_replicas": model.autoscaling.max_replicas,
                "desired": self._desired.get(name),
                "replicas": [
                    {"id": r.id, "url": r.url, "state": r.state.value, "cold_start_s": r.cold_start_s} for r in replicas
                ],
            }
        return {"models": models, "decisions": [asdict(entry) for entry in self.decision_log]}

    async def _serve_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), content_type="text/plain")

    async def _serve_status(self, request: web.Request) -> web.Response:
        return web.json_response(self.status())

