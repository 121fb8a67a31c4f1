"""The simulator at scale (fleet_scale.py): deterministic for a seed, the real policy over a
1,000-replica, three-region fleet, and `ember simulate --at-scale` end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ember.control.autoscaling.fleet_scale import Region, ScaleSimulator, diurnal_rate, policies_for
from ember.control.autoscaling.replica_profile import ReplicaProfile
from ember.gateway.config import load_config

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "autoscaling"
FLEET = load_config(BENCH / "fleet-1000.yaml")
AUTOSCALING = FLEET.models["chat"].autoscaling
PROFILE = ReplicaProfile.model_validate_json((BENCH / "gpu-a.json").read_text())
REGIONS = [Region(name, 1 / 3) for name in sorted(FLEET.regions)]


def simulate(policy: str, seed: int, hours: float = 2.0):
    simulator = ScaleSimulator(AUTOSCALING, PROFILE, REGIONS, FLEET)
    policies = policies_for(policy, AUTOSCALING, simulator.profile, len(REGIONS), simulator.interval_s, static=350)
    # The diurnal peak of 5,000 req/s is at 12 h; these two hours climb from 500 to 800 req/s.
    return simulator.run(diurnal_rate(500, 5000), hours * 3600, policies, seed=seed, initial_replicas=60)


def test_the_same_seed_gives_the_same_run_and_another_seed_another():
    first, again, other = simulate("ember", 7), simulate("ember", 7), simulate("ember", 8)
    assert first == again
    assert first.requests != other.requests


def test_the_policy_meets_the_objectives_on_a_climbing_load_with_fewer_replicas_than_static():
    ember, static = simulate("ember", 1), simulate("static", 1)
    assert ember.slo_attainment >= 0.99
    assert static.slo_attainment == 1.0
    assert static.replica_hours == 3 * 350 * 2  # three regions of 350 for two hours, no cold start counted
    assert ember.replica_hours < static.replica_hours / 2
    assert ember.peak_replicas <= 3 * AUTOSCALING.max_replicas
    assert len(ember.timeline) == 120  # one point a simulated minute


def test_ember_simulate_at_scale_compares_policies_and_hardware_and_plots(tmp_path: Path):
    done = subprocess.run(
        [sys.executable, "-m", "ember.cli", "simulate", str(BENCH / "fleet-1000.yaml"), "--model", "chat",
         "--profile", str(BENCH / "gpu-a.json"), "--hardware", str(BENCH / "gpu-b.json"), "--at-scale",
         "--trace", "diurnal", "--rate", "5000", "--duration-s", "1800", "--policy", "all",
         "--initial-replicas", "60", "--slo-target", "0.5", "--plot", str(tmp_path / "timeline.png")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "3 region(s): eu-west, us-east, us-west; 0.5 h of diurnal, peak 5000 req/s"
    assert [line.split(":")[0] for line in lines[1:4]] == ["ember", "knative", "static"]
    assert lines[4].startswith("hardware gpu-a (assumed numbers): SLO ")
    assert lines[6].startswith("cheapest meeting 50%: gpu-")
    assert lines[-1] == f"wrote {tmp_path / 'timeline.png'}"
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_simulators_use_the_gateways_routing_code_without_its_app():
    """They call the router's own RegionSelector and LeastOutstandingPolicy; those pure modules must
    not pull in the gateway's server (FastAPI app, dispatcher, HTTP clients)."""
    probe = (
        "import sys\n"
        "import ember.control.autoscaling.fleet_scale, ember.control.autoscaling.simulator\n"
        "print(sorted(m for m in ('ember.gateway.app', 'ember.gateway.dispatch', 'fastapi', 'httpx') if m in sys.modules))\n"
        "print('ember.gateway.routing.region' in sys.modules, 'ember.gateway.routing.least_outstanding' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[]", "True True"]
