"""`ember profile` on the tiny model: a very small sweep, the file it writes, and `ember simulate` reading it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

from ember.control.autoscaling.replica_profile import ReplicaProfile


def ember(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ember.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_profile_measures_the_tiny_model_and_the_simulator_reads_it(tiny_model_dir: Path, tmp_path: Path):
    profiled = ember(
        "profile", "--model", str(tiny_model_dir), "-o", "tiny.json", "--prompt-lengths", "8,32",
        "--batch-sizes", "1,2", "--decode-tokens", "4", "--dtype", "float32", "--max-model-len", "128",
        "--kv-cache-memory", "0.02", "--num-threads", "1", "--cost-per-replica-hour", "1.5", cwd=tmp_path,
    )  # fmt: skip
    assert profiled.returncode == 0, profiled.stderr
    assert profiled.stdout.splitlines()[-1] == "wrote tiny.json"
    written = json.loads((tmp_path / "tiny.json").read_text())
    profile = ReplicaProfile.model_validate(written)
    assert profile.model == str(tiny_model_dir)
    assert [point.x for point in profile.ttft_by_prompt_tokens] == [8, 32]
    assert [point.x for point in profile.step_by_batch] == [1, 2]
    assert all(point.seconds > 0 for point in profile.ttft_by_prompt_tokens)
    assert profile.max_batch == 2
    assert profile.cost_per_replica_hour == 1.5
    assert profile.prefill_tokens_per_s > 0 and profile.decode_step_s > 0 and profile.cold_start_s > 0

    fleet = {"models": {"tiny": {"deployments": [{"replicas": []}], "autoscaling": {
        "min_replicas": 1, "max_replicas": 2, "ttft_p90_ms": 60_000, "itl_p90_ms": 10_000,
    }}}}  # fmt: skip
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(fleet))
    simulated = ember(
        "simulate", "fleet.yaml", "--model", "tiny", "--profile", "tiny.json", "--trace", "steady", "--rate", "0.2",
        "--duration-s", "60", cwd=tmp_path,
    )  # fmt: skip
    assert simulated.returncode == 0, simulated.stderr
    # The arrivals depend on the seed only; how many finish within the minute depends on the measured speed.
    first = re.fullmatch(r"requests (\d+), served (\d+), SLO attainment ([\d.]+)%", simulated.stdout.splitlines()[0])
    assert first is not None, simulated.stdout
    assert int(first[1]) == 9
    assert 7 <= int(first[2]) <= 9


def test_a_bad_sweep_is_a_usage_error(tmp_path: Path):
    done = ember("profile", "--model", "x", "--batch-sizes", "1,zero", cwd=tmp_path)
    assert done.returncode == 2
    assert "--batch-sizes: expected comma-separated positive integers, got '1,zero'" in done.stderr
