"""The scaling policy, rule by rule, on scripted observations (deterministic: no clock, no I/O)."""

from __future__ import annotations

import math

from ember.control.autoscaling.policy import (
    AutoscalingPolicy,
    Decision,
    Observation,
    ReplicaLoad,
    WindowLatency,
)
from ember.control.autoscaling.replica_profile import ReplicaProfile
from ember.gateway.config import AutoscalingConfig

CONFIG = dict(
    min_replicas=1, max_replicas=8, ttft_p90_ms=1000, itl_p90_ms=100, queue_wait_p90_ms=500,
    scale_up_delay_s=0, scale_down_delay_s=30, scale_to_zero_after_s=120, stable_window_s=30, panic_window_s=6,
)  # fmt: skip


def policy(**overrides) -> AutoscalingPolicy:
    return AutoscalingPolicy(AutoscalingConfig(**{**CONFIG, **overrides}))


def latency(ratio: float) -> WindowLatency:
    """p90s at `ratio` times the TTFT objective of CONFIG, ITL a little under that."""
    return WindowLatency(ttft_p90_s=ratio * 1.0, itl_p90_s=ratio * 0.099, queue_wait_p90_s=None)


def observe(now: float, ready: int, *, loading=0, queued=0, in_flight=0, requests_total=0.0, stable=1e-9,
            panic=None, kv=0.0) -> Observation:  # fmt: skip
    return Observation(
        now=now, ready=ready, loading=loading, queued=queued, in_flight=in_flight, requests_total=requests_total,
        capacity_per_replica=8, stable=latency(stable), panic=latency(stable if panic is None else panic),
        replicas=tuple(ReplicaLoad(kv_usage=kv) for _ in range(ready)),
    )  # fmt: skip


def test_never_fewer_than_min_replicas():
    assert policy(min_replicas=2).decide(observe(0, 0)) == Decision(2, "min_replicas", "0 running")


def test_a_request_for_a_model_without_ready_replicas_starts_one_and_only_one():
    scaler = policy(min_replicas=0)
    assert scaler.decide(observe(0, 0, queued=3)) == Decision(1, "activate", "3 held, 0 loading")
    # While it loads, more held requests start nothing more: the loading replica counts as started.
    assert scaler.decide(observe(1, 0, loading=1, queued=9)).desired == 1
    # Nothing held and nothing ready: old latencies in the windows do not start anything.
    assert policy(min_replicas=0).decide(observe(5, 0, stable=5.0)) == Decision(0, "hold")


def test_panic_scales_up_at_once_in_proportion_and_ignores_the_up_delay():
    scaler = policy(scale_up_delay_s=60)
    decision = scaler.decide(observe(0, 2, stable=0.5, panic=3.0))
    assert decision == Decision(6, "panic", "ttft at 3.00x on 2 ready")
    # A queue as long as every ready slot is a panic too (2 replicas x 8 slots).
    assert scaler.decide(observe(1, 2, in_flight=16, queued=16, stable=0.5, panic=0.5)).desired == 4


def test_requests_held_for_a_replica_just_admitted_are_not_a_queue_overflow():
    # Scale from zero: the held requests fill the new replica's free slots, about to be dispatched.
    scaler = policy(min_replicas=0)
    assert scaler.decide(observe(0, 0, queued=8)).reason == "activate"
    assert scaler.decide(observe(1, 1, queued=8, stable=0.5)).desired == 1
    # One more than its slots overflows.
    assert scaler.decide(observe(2, 1, queued=9, stable=0.5)) == Decision(2, "panic", "9 queued on 1 ready")


def test_panic_only_scales_up_and_blocks_scale_down_for_a_stable_window():
    scaler = policy(scale_down_delay_s=0)
    scaler.decide(observe(0, 4, panic=2.5))
    for now in range(1, 30):  # quiet right after the burst: no step down inside the stable window
        assert scaler.decide(observe(now, 4, stable=0.1)) == Decision(4, "hold")
    assert scaler.decide(observe(30, 4, stable=0.1)).reason == "scale_down"


def test_a_stable_breach_scales_up_after_the_up_delay_and_only_while_it_lasts():
    scaler = policy(scale_up_delay_s=10)
    assert scaler.decide(observe(0, 2, stable=1.5)) == Decision(2, "hold", "breach for 0.0s")
    assert scaler.decide(observe(9, 2, stable=1.5)).desired == 2
    assert scaler.decide(observe(10, 2, stable=1.5)) == Decision(3, "slo_ttft", "1.50x objective, 0 in flight+queued")
    # The stable window still remembers the breach, the panic window shows it fixed: no more replicas.
    assert scaler.decide(observe(11, 3, stable=1.5, panic=0.7)) == Decision(3, "hold", "2 would be at 2.25x objective, 0% slots, 0% KV")


def test_requests_waiting_for_a_slot_are_a_breach_sized_by_concurrency():
    decision = policy().decide(observe(0, 2, in_flight=16, queued=10, stable=0.5))
    assert decision == Decision(4, "queue", "0.50x objective, 26 in flight+queued")


def test_loading_replicas_are_not_capacity_but_are_not_started_twice():
    assert policy().decide(observe(0, 1, stable=1.5)).desired == 2
    assert policy().decide(observe(0, 1, loading=1, stable=1.5)).desired == 2
    assert policy().decide(observe(0, 1, loading=1, stable=2.9, panic=1.9)).desired == 2
    # A replica that is loading does not serve: no scale down while one loads.
    assert policy(scale_down_delay_s=0).decide(observe(0, 3, loading=1, stable=0.1)) == Decision(4, "hold")


def test_scale_down_waits_the_delay_then_steps_one_replica_at_a_time():
    scaler = policy()
    for now in range(0, 30):
        assert scaler.decide(observe(now, 4, stable=0.3, requests_total=now)).desired == 4
    assert scaler.decide(observe(30, 4, stable=0.3, requests_total=30)) == Decision(3, "scale_down", "3 at 0.40x objective")
    for now in range(31, 61):
        assert scaler.decide(observe(now, 3, stable=0.3, requests_total=now)).desired == 3
    assert scaler.decide(observe(61, 3, stable=0.3, requests_total=61)).desired == 2


def test_no_scale_down_when_one_replica_fewer_would_miss_the_objective_or_fill_its_kv_or_slots():
    assert policy(scale_down_delay_s=0).decide(observe(0, 2, stable=0.5)).desired == 2  # 1 -> 1.00x
    assert policy(scale_down_delay_s=0).decide(observe(0, 2, stable=0.1, kv=0.5)).desired == 2  # 1 -> 100% KV
    assert policy(scale_down_delay_s=0).decide(observe(0, 2, stable=0.1, in_flight=14)).desired == 2  # 14/8 slots
    assert policy(scale_down_delay_s=0).decide(observe(0, 2, stable=0.3, kv=0.3, in_flight=4)).desired == 1


def profiled(decode_step_s: float, per_seq_s: float) -> AutoscalingPolicy:
    profile = ReplicaProfile(
        prefill_tokens_per_s=10_000, decode_step_s=decode_step_s, decode_step_per_seq_s=per_seq_s, max_batch=8,
        cold_start_s=5,
    )  # fmt: skip
    return AutoscalingPolicy(AutoscalingConfig(**{**CONFIG, "scale_down_delay_s": 0}), profile)


def test_with_a_profile_one_replica_fewer_must_keep_the_throughput_the_load_needs():
    # 6 in flight on 2 replicas fill 75% of one replica's slots: the slot check alone lets it go.
    assert policy(scale_down_delay_s=0).decide(observe(0, 2, stable=0.1, in_flight=6)).desired == 1
    # But steps of 20 ms + 2 ms per further sequence run 34 ms at a batch of 8 against 24 ms at 3:
    # one replica completes 8 per 34 steps' time where the load needs 6 per 24, 106% of it.
    held = profiled(0.020, 0.002).decide(observe(0, 2, stable=0.1, in_flight=6))
    assert held == Decision(2, "hold", "1 would be at 0.34x objective, 106% slots, 0% KV")
    # 3 in flight (a batch of 2, 22 ms steps) need 58% of what one replica completes: it goes.
    assert profiled(0.020, 0.002).decide(observe(0, 2, stable=0.1, in_flight=3)).desired == 1


def test_with_a_profile_one_replica_fewer_must_keep_the_itl_objective_by_the_step_time_model():
    # 85 ms steps: the measured ITL (9.9 ms) leaves room, the profile says one replica at a batch of 3
    # steps in 87 ms, over 80% of the 100 ms objective.
    assert policy(scale_down_delay_s=0).decide(observe(0, 2, stable=0.1, in_flight=2)).desired == 1
    held = profiled(0.085, 0.001).decide(observe(0, 2, stable=0.1, in_flight=2))
    assert held == Decision(2, "hold", "1 would be at 0.87x objective, 27% slots, 0% KV")


def test_scale_to_zero_after_idle_and_any_request_restarts_the_idle_clock():
    scaler = policy(min_replicas=0)
    scaler.decide(observe(0, 1, requests_total=5))
    assert scaler.decide(observe(100, 1, requests_total=6)).desired == 1  # a request finished at 100
    assert scaler.decide(observe(219, 1, requests_total=6)).desired == 1
    assert scaler.decide(observe(220, 1, requests_total=6)) == Decision(0, "scale_to_zero", "idle 120s")
    assert policy(min_replicas=1).decide(observe(500, 1)).desired == 1


def test_max_replicas_caps_every_rule():
    decision = policy(max_replicas=3).decide(observe(0, 2, panic=5.0))
    assert decision == Decision(3, "panic", "ttft at 5.00x on 2 ready; wanted 10, capped at max_replicas")


def run_plant(scaler: AutoscalingPolicy, demand, seconds: int, load_time_s: int = 5) -> list[tuple[int, int, int]]:
    """A fleet whose p90s are demand/ready times the objectives (demand 1.0 = one replica's worth),
    whose replicas take `load_time_s` to load, decided every second. Returns the scale events."""
    ready, loading = 1, []  # loading: the times replicas become ready
    events = []
    requests_total = 0.0
    for now in range(seconds):
        ready += sum(1 for at in loading if at == now)
        loading = [at for at in loading if at > now]
        load = demand(now)
        requests_total += load * 10
        ratio = load / ready if ready else 0.0
        decision = scaler.decide(observe(now, ready, loading=len(loading), stable=ratio, in_flight=math.ceil(load * 4),
                                         requests_total=requests_total, kv=min(ratio * 0.3, 1.0)))  # fmt: skip
        current = ready + len(loading)
        if decision.desired > current:
            loading += [now + load_time_s] * (decision.desired - current)
            events.append((now, current, decision.desired))
        elif decision.desired < current:
            ready -= current - decision.desired
            events.append((now, current, decision.desired))
    return events


def test_a_load_one_replica_almost_serves_does_not_flap_over_two_hours():
    assert run_plant(policy(), lambda now: 0.95, 7200) == []
    # Just over one replica: one step up, then two replicas hold (one fewer would be at 1.1x).
    assert run_plant(policy(), lambda now: 1.1, 7200) == [(0, 1, 2)]


def test_a_square_wave_load_scales_with_each_burst_and_back_the_same_decisions_every_run():
    def square(now: int) -> float:
        return 2.5 if (now // 600) % 2 else 0.3

    events = run_plant(policy(), square, 3600)
    assert events == run_plant(policy(), square, 3600)
    ups = [event for event in events if event[2] > event[1]]
    downs = [event for event in events if event[2] < event[1]]
    assert [now for now, _, _ in ups] == [600, 1800, 3000]  # panic at each burst's first second: 2.5x
    assert all(to == 3 for _, _, to in ups)
    # Between bursts it steps 3 -> 2 -> 1, each step a scale_down_delay_s apart, never below min.
    assert [(frm, to) for _, frm, to in downs] == [(3, 2), (2, 1)] * 2


def test_latencies_of_requests_held_through_a_cold_start_do_not_scale_up():
    scaler = policy(min_replicas=0)
    assert scaler.decide(observe(0, 0, queued=3)).reason == "activate"
    assert scaler.decide(observe(5, 0, loading=1, queued=3)).desired == 1
    # Ready at 8 s; the held requests report their 8 s wait as TTFT (8x the objective).
    for now in range(8, 20):
        assert scaler.decide(observe(now, 1, in_flight=3, requests_total=now, stable=8.0, panic=8.0)).desired == 1
    # Two panic windows after the change the panic window speaks for the current capacity again.
    assert scaler.decide(observe(20, 1, in_flight=3, requests_total=20, stable=8.0, panic=8.0)).reason == "panic"


def test_a_recorded_run_replays_to_the_same_decisions():
    import json
    from dataclasses import asdict

    from ember.control.autoscaling.policy import observation_from_dict

    scaler = policy(min_replicas=0)
    script = [observe(0, 0, queued=2), observe(3, 0, loading=1, queued=2), observe(9, 1, in_flight=2, stable=0.4),
              observe(30, 1, requests_total=2), observe(200, 1, requests_total=2)]  # fmt: skip
    recorded = json.loads(json.dumps([(asdict(obs), asdict(scaler.decide(obs))) for obs in script]))
    replay = policy(min_replicas=0)
    assert [asdict(replay.decide(observation_from_dict(obs))) for obs, _ in recorded] == [d for _, d in recorded]
    assert [d["reason"] for _, d in recorded] == ["activate", "activate", "hold", "hold", "scale_to_zero"]
