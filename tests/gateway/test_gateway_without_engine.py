"""A gateway host installs `ember[gateway]` only: `ember keys`, `ember up` and the gateway it starts
must run with the engine's and bench's packages (torch, numpy, tokenizers, matplotlib, ...) absent.

The CLI runs in subprocesses whose sitecustomize makes importing any of those packages fail, so an
import anywhere on these paths (the parser of every subcommand included) fails the command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from gateway_harness import FakeReplica, free_port, http, sha256

REPO_ROOT = Path(__file__).resolve().parents[2]
# Everything only the `engine` and `bench` extras install (and transformers, a test-only package).
ABSENT_PACKAGES = (
    "torch", "numpy", "safetensors", "tokenizers", "gguf", "jinja2", "tqdm", "matplotlib", "aiohttp", "transformers",
)  # fmt: skip
SITECUSTOMIZE = f"""
import sys

ABSENT = {ABSENT_PACKAGES!r}


class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {{name!r}} (absent on a gateway host)", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
"""
KEY = "sk-ember-gateway-host-test"


@pytest.fixture
def gateway_host_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a process that cannot import the absent packages (children inherit it)."""
    site = tmp_path / "gateway-host-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO_ROOT)]), "PYTHONUNBUFFERED": "1"}


def ember(env: dict[str, str], *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ember.cli", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_the_blocker_really_blocks(gateway_host_env: dict[str, str], tmp_path: Path):
    done = subprocess.run(
        [sys.executable, "-c", "import torch"], env=gateway_host_env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    assert "No module named 'torch' (absent on a gateway host)" in done.stderr


def test_keys_commands_run_without_engine_packages(gateway_host_env: dict[str, str], tmp_path: Path):
    hashed = ember(gateway_host_env, "keys", "hash", KEY, cwd=tmp_path)
    assert hashed.returncode == 0, hashed.stderr
    assert hashed.stdout.split() == [sha256(KEY)]

    created = ember(gateway_host_env, "keys", "create", "--db", "keys.db", "--name", "alice", "--json", cwd=tmp_path)
    assert created.returncode == 0, created.stderr
    assert '"name": "alice"' in created.stdout and "sk-ember-" in created.stdout
    listed = ember(gateway_host_env, "keys", "list", "--db", "keys.db", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "alice" in listed.stdout

    for command in ("serve", "gateway", "up", "keys", "bench", "generate"):  # every parser builds
        helped = ember(gateway_host_env, command, "--help", cwd=tmp_path)
        assert helped.returncode == 0, (command, helped.stderr)


def test_a_command_whose_extra_is_missing_says_which_one_to_install(gateway_host_env: dict[str, str], tmp_path: Path):
    served = ember(gateway_host_env, "serve", "--model", "smollm2-135m-instruct", cwd=tmp_path)
    assert served.returncode == 2
    assert served.stderr.splitlines() == [
        "ember serve: error: No module named 'torch' (absent on a gateway host); install it with: "
        "pip install 'ember[engine]'"
    ]


def test_ember_up_runs_the_gateway_with_every_extension_without_engine_packages(
    gateway_host_env: dict[str, str], tmp_path: Path
):
    replica = FakeReplica("upstream").start()
    gateway_port, grpc_port = free_port(), free_port()
    fleet = {
        "models": {"tiny": {"deployments": [{"replicas": [{"url": replica.url}]}]}},
        "keys": {"inline": [{"name": "host-test", "sha256": sha256(KEY)}]},
        "health": {"interval_s": 0.2},
        "async": {"store": "jobs.db", "grpc": {"port": grpc_port}},  # jobs, Batch, files, WebSocket and gRPC
        "launch": {"gateway": {"port": gateway_port}, "shutdown_timeout_s": 20},  # no local replicas
    }
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(fleet))
    up = subprocess.Popen(
        [sys.executable, "-m", "ember.cli", "up", "fleet.yaml"],
        env=gateway_host_env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    gateway = f"http://127.0.0.1:{gateway_port}"
    try:
        ready = _wait_ready(gateway, up)
        if ready:
            answer = http.post(
                f"{gateway}/v1/chat/completions",
                headers={"authorization": f"Bearer {KEY}"},
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
            )
            batches = http.get(f"{gateway}/v1/batches", headers={"authorization": f"Bearer {KEY}"})
    finally:
        up.send_signal(signal.SIGTERM)
        output, _ = up.communicate(timeout=60)
        replica.stop()
    assert ready, output
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["message"]["content"] == "Hello from upstream"
    assert batches.status_code == 200
    assert batches.json()["data"] == []
    assert up.returncode == 0, output
    assert "ModuleNotFoundError" not in output
    assert output.rstrip().endswith("[ember up] all processes stopped")


def _wait_ready(url: str, up: subprocess.Popen, limit_s: float = 120.0) -> bool:
    """Whether the gateway answered /ready before `ember up` exited or the (hang-stopping) limit passed."""
    deadline = time.monotonic() + limit_s
    while up.poll() is None and time.monotonic() < deadline:
        try:
            if http.get(f"{url}/ready", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


def test_autoscaled_ember_up_serves_its_control_endpoint_without_engine_or_bench_packages(
    gateway_host_env: dict[str, str], tmp_path: Path
):
    """The autoscaler's /metrics, /status and /rounds run on the gateway's HTTP stack (no aiohttp).
    min_replicas 0 and no request: the policy starts no replica."""
    gateway_port, control_port = free_port(), free_port()
    fleet = {
        "models": {"tiny": {"deployments": [{"replicas": []}], "autoscaling": {
            "min_replicas": 0, "max_replicas": 1, "ttft_p90_ms": 2000, "itl_p90_ms": 200,
        }}},  # fmt: skip
        "keys": {"inline": [{"name": "host-test", "sha256": sha256(KEY)}]},
        "launch": {
            "gateway": {"port": gateway_port},
            "autoscaled": {"tiny": {"model": "unused-never-started", "capacity": 2}},
            "autoscaler": {"interval_s": 0.2, "port": control_port},
            "shutdown_timeout_s": 20,
        },
    }
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(fleet))
    up = subprocess.Popen(
        [sys.executable, "-m", "ember.cli", "up", "fleet.yaml"],
        env=gateway_host_env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    control = f"http://127.0.0.1:{control_port}"
    try:
        ready = _wait_ready(f"http://127.0.0.1:{gateway_port}", up)
        decided = ready and _wait_for_decision(control, up)
        if decided:
            status = http.get(f"{control}/status").json()
            metrics = http.get(f"{control}/metrics")
            rounds = http.get(f"{control}/rounds").json()
    finally:
        up.send_signal(signal.SIGTERM)
        output, _ = up.communicate(timeout=60)
    assert ready and decided, output
    assert status["models"]["tiny"]["desired"] == 0
    assert status["models"]["tiny"]["replicas"] == []
    assert metrics.status_code == 200
    assert 'ember_autoscaler_desired_replicas{model="tiny"} 0.0' in metrics.text
    assert rounds["tiny"]["complete"] is True
    assert rounds["tiny"]["rounds"][0]["decision"]["desired"] == 0
    assert up.returncode == 0, output
    # The local provider's standby `ember serve` needs torch and keeps failing here; nothing else may.
    missing = {line.split(error)[1].split()[0] for line in output.splitlines() if (error := "Error: No module named ") in line}
    assert missing <= {"'torch'"}, output
    assert output.rstrip().endswith("[ember up] all processes stopped")


def _wait_for_decision(control: str, up: subprocess.Popen, limit_s: float = 60.0) -> bool:
    """Whether the autoscaler's endpoint reported a first decision before `ember up` exited or the limit."""
    deadline = time.monotonic() + limit_s
    while up.poll() is None and time.monotonic() < deadline:
        try:
            if http.get(f"{control}/status", timeout=1).json()["models"]["tiny"]["desired"] is not None:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False
