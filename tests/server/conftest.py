"""Real `ember serve` processes on loopback for the server tests."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port, stop_process

API_KEY = "test-key"
MODEL_NAME = "tiny"



class ServerProcess:
    """One `ember serve` subprocess; its stdout+stderr go to `log_path`."""

    def __init__(
        self, model_dir: Path, log_path: Path, *extra_args: str, data_limit: int | None = None
    ) -> None:
        """`data_limit`: the server's RLIMIT_DATA in bytes (inherited by its tensor-parallel workers)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [
            sys.executable,
            "-m",
            "ember.cli",
            "serve",
            "--model",
            str(model_dir),
            "--dtype",
            "float32",
            "--num-threads",
            "1",
            "--served-model-name",
            MODEL_NAME,
            "--port",
            str(self.port),
            "--kv-cache-memory",
            "0.05",
            *extra_args,
        ]
        self._log = open(log_path, "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        limit = (
            None
            if data_limit is None
            else (lambda: resource.setrlimit(resource.RLIMIT_DATA, (data_limit,) * 2))
        )
        self.proc = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=env, preexec_fn=limit
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ember serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"ember serve was not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, keyed `name{label="value",...}` (labels sorted), parsed by prometheus_client."""
        text = httpx.get(f"{self.url}/metrics", timeout=10.0).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}"] = sample.value
        return samples

    @staticmethod
    def metric(samples: dict[str, float], name: str, **labels: str) -> float:
        """One sample's value (0 when absent); model_name="tiny" is implied."""
        labels = {"model_name": MODEL_NAME, **labels}
        key = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
        return samples.get(key, 0.0)

    def wait_for_metric(self, name: str, value: float, timeout: float = 60.0) -> dict[str, float]:
        """Poll /metrics until `name` equals `value` (or time out); returns the last samples."""
        deadline = time.monotonic() + timeout
        while True:
            samples = self.metrics()
            if self.metric(samples, name) == value or time.monotonic() > deadline:
                return samples
            time.sleep(0.05)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> int:
        stop_process(self.proc, 30)
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The shared server: API key required, 64 KiB body limit."""
    log_path = tmp_path_factory.mktemp("server") / "serve.log"
    process = ServerProcess(
        tiny_model_dir, log_path, "--api-key", API_KEY, "--max-request-body-bytes", "65536"
    )
    yield process
    process.stop()


@pytest.fixture(scope="session")
def api_key() -> str:
    return API_KEY


@pytest.fixture(scope="session")
def model_name() -> str:
    return MODEL_NAME


@pytest.fixture(scope="session")
def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="session")
def launch_server(tmp_path_factory: pytest.TempPathFactory):
    """Start another `ember serve` (model dir, extra flags); the caller stops it."""

    def launch(model_dir: Path, *extra_args: str) -> ServerProcess:
        return ServerProcess(model_dir, tmp_path_factory.mktemp("serve") / "serve.log", *extra_args)

    return launch
