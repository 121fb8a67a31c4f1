"""Shared harness of the async-jobs, Batch, WebSocket and gRPC tests: the real gateway app with its
protocol extensions on uvicorn, a real `ember serve` replica of the tiny model, and a real webhook
receiver. Import the fixtures into a test module to use them."""

from __future__ import annotations

import http.server
import io
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import openai
import pytest
from gateway_harness import ServerThread, free_port, sha256, wait_until

from ember.gateway.app import GatewayApp, create_app
from ember.gateway.config import parse_config
from ember.gateway.extensions import JobsExtension, protocol_extensions

KEY = "sk-test-alpha"
OTHER_KEY = "sk-test-beta"


class ProtocolGateway:
    """The real gateway app with async jobs, Batch API, WebSocket (and gRPC when grpc_port is set)."""

    def __init__(self, config: dict, base_dir: Path, grpc_port: int | None = None):
        self.config = parse_config(config, base_dir=base_dir)
        self.grpc_port = grpc_port
        self.app: GatewayApp = create_app(self.config, protocol_extensions(self.config, grpc_port))
        self.server = ServerThread(self.app)
        self.url = self.server.url
        self.ws_url = self.url.replace("http://", "ws://") + "/v1/ws"

    @property
    def jobs(self) -> JobsExtension:
        return next(ext for ext in self.app.extensions if isinstance(ext, JobsExtension))

    def metric(self, name: str, **labels: str) -> float:
        value = self.app.dispatcher.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    def start(self) -> ProtocolGateway:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()


def protocol_config(replica_urls: list[str], *, capacity: int = 4, **extra) -> dict:
    """Model `tiny` on the given replicas; keys alpha (all models) and beta; loopback webhooks allowed."""
    config = {
        "models": {
            "tiny": {
                "deployments": [
                    {
                        "replicas": [
                            {"url": url, "id": f"r{i}", "capacity": capacity}
                            for i, url in enumerate(replica_urls)
                        ]
                    }
                ]
            }
        },
        "keys": {
            "inline": [
                {"name": "alpha", "sha256": sha256(KEY)},
                {"name": "beta", "sha256": sha256(OTHER_KEY)},
            ]
        },
        "health": {"interval_s": 0.5, "timeout_s": 1.0, "unhealthy_threshold": 3},
        "scrape": {"interval_s": 5},
        "async": {
            "store": "jobs.db",  # next to the config: the test's tmp folder
            "jobs": {"concurrency": 2, "poll_interval_s": 0.05},
            "webhooks": {
                "allow": ["127.0.0.0/8"],
                "backoff_initial_s": 0.05,
                "backoff_max_s": 0.2,
                "timeout_s": 5,
            },
        },
    }
    for section, value in extra.items():
        if isinstance(value, dict) and isinstance(config.get(section), dict):
            config[section] = {**config[section], **value}
        else:
            config[section] = value
    return config


def auth(key: str = KEY) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def start_ember_serve(
    model_dir: Path, log_path: Path, max_model_len: int = 1024, extra_args: Sequence[str] = ()
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [
        sys.executable, "-m", "ember.cli", "serve", "--model", str(model_dir), "--dtype", "float32",
        "--served-model-name", "tiny", "--port", str(port), "--num-threads", "1", "--max-model-len", str(max_model_len),
        *extra_args,
    ]  # fmt: skip
    log = open(log_path, "wb")  # noqa: SIM115 - closed with the process
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if process.poll() is not None:
            raise AssertionError(
                f"ember serve exited with {process.returncode}: {log_path.read_text()[-2000:]}"
            )
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(healthy, timeout_s=120, what="ember serve to become healthy")
    return process, url


def replica_metric(replica_url: str, name: str) -> float:
    for line in httpx.get(replica_url + "/metrics").text.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"the replica exports no {name}")


def stop_process(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


_shared_replica: tuple[subprocess.Popen, str] | None = None


@pytest.fixture(scope="session")
def real_replica(long_context_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real `ember serve` replica of the tiny model (float32, 16384-token context, so a request can
    outlast a deadline) for the whole session: each test module that imports this fixture gets its own
    session-scoped definition, so the process is cached here and started once (two cores: one model
    server is plenty)."""
    global _shared_replica
    if _shared_replica is None or _shared_replica[0].poll() is not None:
        positions = json.loads((long_context_model_dir / "config.json").read_text())[
            "max_position_embeddings"
        ]
        _shared_replica = start_ember_serve(
            long_context_model_dir, tmp_path_factory.mktemp("replica") / "serve.log", max_model_len=positions
        )
    yield _shared_replica[1]
    stop_process(_shared_replica[0])


class WebhookReceiver:
    """A real HTTP server that records deliveries and answers from a script of status codes."""

    def __init__(self, statuses: list[int] | None = None, delay_s: float = 0.0):
        self.statuses = list(statuses or [])
        self.delay_s = delay_s
        self.deliveries: list[tuple[dict[str, str], bytes]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers["content-length"]))
                if receiver.delay_s:
                    time.sleep(receiver.delay_s)
                with receiver.lock:
                    receiver.deliveries.append(({k.lower(): v for k, v in self.headers.items()}, body))
                    status = receiver.statuses.pop(0) if receiver.statuses else 200
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> WebhookReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def chat_batch_line(custom_id: str, model: str = "tiny", content: str = "Hello") -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 3},
    }


def create_chat_batch(gateway_url: str, key: str, custom_ids: Sequence[str], model: str = "tiny") -> str:
    """Uploads one chat line per custom id and creates their batch with the openai SDK; the batch's id."""
    client = openai.OpenAI(base_url=gateway_url + "/v1", api_key=key, max_retries=0)
    lines = (json.dumps(chat_batch_line(custom_id, model)).encode() + b"\n" for custom_id in custom_ids)
    uploaded = client.files.create(file=("requests.jsonl", io.BytesIO(b"".join(lines))), purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    ).id
