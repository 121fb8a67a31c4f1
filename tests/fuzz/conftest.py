"""The processes under fuzz: one `ember serve` of the tiny model (with an API key), and one real
`ember gateway` process in front of another tiny replica, with async jobs, a key store and the admin API."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "gateway"))

from fuzz_targets import ADMIN_KEY, GATEWAY_KEY, SERVER_KEY, FuzzTarget  # noqa: E402
from gateway_harness import free_port, sha256, wait_until  # noqa: E402
from protocols_support import start_ember_serve, stop_process  # noqa: E402


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzTarget]:
    log_path = tmp_path_factory.mktemp("fuzz-serve") / "serve.log"
    extra = ["--api-key", SERVER_KEY, "--max-request-body-bytes", "65536"]
    process, url = start_ember_serve(tiny_model_dir, log_path, extra_args=extra)
    target = FuzzTarget(process, url, SERVER_KEY, log_path)
    yield target
    target.client.close()
    stop_process(process)


@pytest.fixture(scope="module")
def fuzz_gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzTarget]:
    folder = tmp_path_factory.mktemp("fuzz-gateway")
    replica, replica_url = start_ember_serve(tiny_model_dir, folder / "replica.log")
    config = {
        "admin_key_sha256": sha256(ADMIN_KEY),
        "models": {"tiny": {
            "routing": {"policy": "prefix-cache"},  # the default fleet's policy: it reads the prompt too
            "deployments": [{"replicas": [{"url": replica_url, "id": "r0", "capacity": 4}]}],
        }},
        "keys": {"store": "keys.db", "inline": [{"name": "fuzz", "sha256": sha256(GATEWAY_KEY)}]},
        "limits": {"max_body_bytes": 65536},
        "health": {"interval_s": 0.5, "timeout_s": 2.0, "unhealthy_threshold": 3},
        "async": {"store": "jobs.db", "jobs": {"concurrency": 1, "poll_interval_s": 0.1}},
    }
    (folder / "gateway.yaml").write_text(yaml.safe_dump(config))
    port = free_port()
    log_path = folder / "gateway.log"
    with open(log_path, "wb") as log:
        command = [sys.executable, "-m", "ember.cli", "gateway", "--config", str(folder / "gateway.yaml"),
                   "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    target = FuzzTarget(process, f"http://127.0.0.1:{port}", GATEWAY_KEY, log_path)

    def ready() -> bool:
        assert process.poll() is None, f"ember gateway exited: {log_path.read_text()[-3000:]}"
        try:
            return target.client.get("/ready", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(ready, timeout_s=120, what="ember gateway to be ready")
    yield target
    target.client.close()
    stop_process(process)
    stop_process(replica)
