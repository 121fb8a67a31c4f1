"""The fleet simulator: the real policy over simulated replicas, deterministic for a seed."""

from __future__ import annotations

import json

import yaml

from ember.control.autoscaling.replica_profile import ReplicaProfile
from ember.control.autoscaling.simulator import FleetSimulator, bursty, diurnal, steady
from ember.gateway.config import AutoscalingConfig

# One replica: 256-token prompts prefill in 0.128 s, 64 tokens decode in ~1.3-2.2 s: about 5 requests/s.
PROFILE = ReplicaProfile(
    prefill_tokens_per_s=2000, decode_step_s=0.02, decode_step_per_seq_s=0.002, max_batch=8, cold_start_s=5
)
CONFIG = dict(
    min_replicas=1, max_replicas=6, ttft_p90_ms=1000, itl_p90_ms=60, scale_down_delay_s=30,
    scale_to_zero_after_s=60, stable_window_s=30, panic_window_s=6, cost_per_replica_hour=1.0,
)  # fmt: skip


def simulate(seed: int = 7, **overrides):
    # 1 request/s, and 10x that for 60 s after every 240 s: bursts at 240-300 s and 540-600 s.
    arrivals = bursty(base_rate=1, burst_rate=10, on_s=60, off_s=240, duration_s=600, seed=seed)
    simulator = FleetSimulator(AutoscalingConfig(**{**CONFIG, **overrides}), PROFILE, interval_s=1.0)
    return arrivals, simulator.run(arrivals, duration_s=640)


def test_the_same_seed_gives_the_same_run_and_another_seed_another():
    _, first = simulate()
    _, again = simulate()
    assert first == again
    assert simulate(seed=8)[1] != first


def test_a_10x_burst_is_met_by_the_panic_window_within_seconds_and_every_request_is_served():
    arrivals, report = simulate()
    assert report.served == report.requests == len(arrivals)
    first_burst = [(at, reason) for at, current, desired, reason in report.decisions if 240 <= at < 300]
    assert first_burst[0] == (242.0, "panic")  # two decision intervals after the burst began
    assert {reason for _, reason in first_burst} == {"panic"}
    downs = [at for at, current, desired, _ in report.decisions if desired < current]
    assert downs and min(downs) > 300  # back down only after the burst, a replica per scale_down_delay_s
    assert report.flaps == 0 and report.cold_starts == 10


def test_autoscaling_costs_less_than_static_peak_provisioning():
    _, scaled = simulate()
    peak = max(desired for _, _, desired, _ in scaled.decisions)
    _, static = simulate(min_replicas=peak, max_replicas=peak)
    assert static.scale_events == 0 and round(static.replica_seconds) == peak * 640
    assert scaled.replica_seconds < 0.5 * static.replica_seconds
    assert scaled.cost_per_million_tokens < 0.5 * static.cost_per_million_tokens
    # The price: requests that arrive while the burst's replicas cold-start (5 s) miss the TTFT objective.
    assert static.slo_attainment == 1.0 and 0.8 < scaled.slo_attainment < 0.9


def test_scale_to_zero_and_back_serves_every_request():
    arrivals, report = simulate(min_replicas=0, scale_to_zero_after_s=20)
    reasons = [reason for _, _, _, reason in report.decisions]
    assert "scale_to_zero" in reasons and "activate" in reasons
    assert report.served == len(arrivals)


def test_ember_simulate_replays_a_jsonl_trace_and_reports(tmp_path, capsys):
    from ember.cli import main

    fleet = {"models": {"tiny": {"deployments": [{"replicas": []}], "autoscaling": {**CONFIG, "min_replicas": 0}}},
             "keys": {"inline": [{"name": "t", "sha256": "0" * 64}]}}  # fmt: skip
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(fleet))
    (tmp_path / "profile.json").write_text(PROFILE.model_dump_json())
    # Three requests at t=10 s: the model starts from zero, so they wait out the 5 s cold start.
    (tmp_path / "trace.jsonl").write_text(
        "".join(json.dumps({"time_s": 10.0, "prompt_tokens": 200, "output_tokens": 20}) + "\n" for _ in range(3))
    )
    args = ["simulate", str(tmp_path / "fleet.yaml"), "--model", "tiny", "--profile", str(tmp_path / "profile.json"),
            "--trace", str(tmp_path / "trace.jsonl"), "--duration-s", "100", "--interval-s", "1"]  # fmt: skip
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "requests 3, served 3, SLO attainment 0.0%"  # 5 s cold start > the 1 s TTFT objective
    assert lines[2] == "cold starts 1, scale events 2, flaps 0"
    assert lines[3].split() == ["t=", "10.0s", "0", "->", "1", "activate"]
    assert lines[4].split() == ["t=", "76.0s", "1", "->", "0", "scale_to_zero"]  # 60 s after the last finished
    (tmp_path / "profile.json").write_text('{"prefill_tokens_per_s": 0}')
    assert main(args) == 2
    assert "prefill_tokens_per_s: Input should be greater than 0" in capsys.readouterr().err


def test_generated_traces_are_reproducible_and_follow_their_rate():
    assert steady(2.0, 1000, seed=1) == steady(2.0, 1000, seed=1)
    assert 1900 < len(steady(2.0, 1000, seed=1)) < 2100
    day = diurnal(0.2, 2.0, period_s=1000, duration_s=1000, seed=1)
    night, noon = [a for a in day if a.time_s < 100], [a for a in day if 450 <= a.time_s < 550]
    assert len(noon) > 5 * len(night)
