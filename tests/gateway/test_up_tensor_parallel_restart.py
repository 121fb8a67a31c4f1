"""`ember up` restarts a tensor-parallel replica whose worker died: killing the worker makes `ember serve`
exit non-zero (tests/server/test_server_tensor_parallel.py), the supervisor starts it again, with a new
worker, and the gateway serves through it once more. Real processes: ember up, its gateway, one
`ember serve --tensor-parallel-size 2` replica of the tiny model, the openai SDK."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.conftest import free_port, wait_for
from tests.gateway.test_routing_fleet_e2e import KEY, KEY_SHA256, scrape
from tests.server.test_server_tensor_parallel import worker_pids

pytestmark = pytest.mark.slow


def children(pid: int) -> dict[int, str]:
    """pid -> command line of the process's children."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in map(int, (task / "children").read_text().split()):
            try:
                found[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except FileNotFoundError:
                continue
    return found


def test_up_restarts_a_replica_whose_tensor_parallel_worker_died(tmp_path, tiny_model_dir):
    gateway_port, replica_port = free_port(), free_port()
    args = [
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "0.02",
        "--num-threads",
        "1",
        "--tensor-parallel-size",
        "2",
    ]
    config = {
        "models": {
            "tiny": {"deployments": [{"replicas": [{"url": f"http://127.0.0.1:{replica_port}", "id": "tp"}]}]}
        },
        "keys": {"inline": [{"name": "test", "sha256": KEY_SHA256}]},
        "health": {"interval_s": 0.3, "timeout_s": 2.0, "unhealthy_threshold": 1},
        "launch": {
            "gateway": {"port": gateway_port},
            "replicas": [{"port": replica_port, "model": str(tiny_model_dir), "args": args}],
            "restart": {"initial_backoff_s": 0.1, "max_backoff_s": 1.0},
            "shutdown_timeout_s": 60,
        },
    }
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(config))
    up = subprocess.Popen(
        [sys.executable, "-m", "ember.cli", "up", str(tmp_path / "fleet.yaml")],
        cwd=tmp_path,  # the gateway's default job store is ./ember-jobs.db
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(up.stdout), daemon=True)
    reader.start()
    gateway = f"http://127.0.0.1:{gateway_port}"
    client = openai.OpenAI(base_url=gateway + "/v1", api_key=KEY, max_retries=0, timeout=120)

    def admitted() -> bool:
        try:
            metrics = scrape(gateway + "/metrics")
        except httpx.HTTPError:  # the gateway is not up yet
            return False
        return any(
            name == "ember_gateway_replica_healthy" and ("replica", "tp") in labels and value == 1
            for (name, labels), value in metrics.items()
        )

    def serve_pids() -> list[int]:
        return [pid for pid, cmd in children(up.pid).items() if f"--port {replica_port} " in cmd + " "]

    def complete() -> str:
        completion = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0)
        return completion.choices[0].text

    try:
        wait_for(admitted, "the gateway to admit the tensor-parallel replica")
        answer = complete()
        (serve_pid,) = serve_pids()
        (worker,) = worker_pids(serve_pid)
        os.kill(worker, signal.SIGKILL)

        restarted = wait_for(
            lambda: [pid for pid in serve_pids() if pid != serve_pid], "ember up to restart serve"
        )
        assert not Path(f"/proc/{serve_pid}").exists()
        assert f"replica-{replica_port} exited with code 1" in "".join(
            lines
        )  # not hung, not killed by ember up
        wait_for(lambda: len(worker_pids(restarted[0])) == 1, "the restarted serve's worker")
        wait_for(admitted, "the gateway to re-admit the restarted replica")
        assert complete() == answer  # greedy, through both ranks again

        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=120) == 0
        new_worker = worker_pids(restarted[0]) if Path(f"/proc/{restarted[0]}").exists() else []
        assert not new_worker and not Path(f"/proc/{restarted[0]}").exists()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        reader.join(timeout=10)
