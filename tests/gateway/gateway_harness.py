"""Gateway test harness (import it as `gateway_harness`; tests/gateway/conftest.py puts this folder
on sys.path): real uvicorn servers on 127.0.0.1 in background threads.

`FakeReplica` is a small OpenAI-compatible Starlette upstream whose behaviour a test controls
(hold requests, fail with a status, die mid-stream, report unhealthy); it is used where a test is
about the gateway's own behaviour. `GatewayServer` runs the real gateway app. Tests that need real
model replicas start `ember serve` processes (`EmberServe`) instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ember.gateway.app import GatewayApp, create_app
from ember.gateway.config import GatewayConfig, parse_config
from ember.gateway.replicas import ReplicaPool
from tests.conftest import stop_process

# One client for the tests' plain calls, with a timeout that a loaded 2-core machine cannot trip. No
# kept-alive connections: uvicorn closes an idle one after 5 s, and a request sent on it just as it closes
# fails with "Server disconnected without sending a response" (seen once in CI, between two tests that
# were about 5 s apart). Clients that keep connections retry such a request (the openai SDK, the gateway).
http = httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    """Poll for a state change in another thread (not a timing assertion: the bound only stops a hang)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def admitted_pool(config: GatewayConfig) -> ReplicaPool:
    """The replicas of `config` as after a first round of passing health probes (routing tests)."""
    pool = ReplicaPool.from_config(config)
    for replica in pool.all():
        pool.mark_success(replica)
    return pool


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class ServerThread:
    """A uvicorn server for `app` on its own event loop thread; stop() closes its connections."""

    def __init__(self, app, port: int | None = None, host: str = "127.0.0.1"):
        self.app = app
        self.host = host
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        config = uvicorn.Config(
            self.app, host=self.host, port=self.port, log_level="warning", access_log=False,
            lifespan="auto", timeout_graceful_shutdown=1, loop="asyncio", http="httptools",
        )  # fmt: skip
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        wait_until(lambda: self._server.started or not self._thread.is_alive(), what=f"server on {self.port}")
        if not self._server.started:
            raise RuntimeError(f"server on port {self.port} did not start")

    def _run(self) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            await self._server.serve()

        asyncio.run(main())

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None

    def call(self, fn) -> None:
        """Run fn() on the server's loop thread and wait for it."""

        async def run() -> None:
            fn()

        asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=10)


class FakeReplica:
    """An OpenAI-compatible upstream with knobs. Responses say which replica served them."""

    def __init__(self, name: str, port: int | None = None, host: str = "127.0.0.1"):
        self.name = name
        self.requests: list[dict] = []  # bodies, in arrival order
        self.in_flight = 0
        self.max_in_flight = 0
        self.fail_status: int | None = None
        self.health_status = 200
        self.hold_requests = False  # park every request until release()
        self.pause_after_first_chunk = False  # park streams after their first chunk until release()
        self.die_after_chunks: int | None = None  # abort the connection mid-stream
        self.chunks = ["Hello", " from", " " + name]
        self.usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
        self.aborted = 0  # streams the client (the gateway) hung up on
        self.authorizations: dict[str, set[str | None]] = {}  # path -> Authorization headers received
        self._gate: asyncio.Event | None = None
        routes = [
            Route("/v1/chat/completions", self._completion, methods=["POST"]),
            Route("/v1/completions", self._completion, methods=["POST"]),
            Route("/health", self._health),
            Route("/metrics", self._metrics),
        ]
        self.server = ServerThread(Starlette(routes=routes, lifespan=self._lifespan), port, host)
        self.server.app.add_middleware(_RecordAuthorization, replica=self)

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> FakeReplica:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()

    def hold(self) -> None:
        self.server.call(lambda: self._gate.clear())
        self.hold_requests = True

    def release(self) -> None:
        self.hold_requests = False
        self.pause_after_first_chunk = False
        self.server.call(lambda: self._gate.set())

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette):
        self._gate = asyncio.Event()
        self._gate.set()
        yield

    async def _health(self, request: Request) -> Response:
        return PlainTextResponse(
            "ok" if self.health_status == 200 else "down", status_code=self.health_status
        )

    async def _metrics(self, request: Request) -> Response:
        return PlainTextResponse(
            f"vllm:num_requests_running {self.in_flight}\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.0\n"
        )

    async def _completion(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        self.requests.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.hold_requests:
                await self._gate.wait()
            if self.fail_status is not None:
                error = {"message": f"{self.name} fails", "type": "server_error", "param": None, "code": None}
                return JSONResponse({"error": error}, status_code=self.fail_status)
            chat = request.url.path.endswith("chat/completions")
            if body.get("stream"):
                include_usage = (body.get("stream_options") or {}).get("include_usage") is True
                return StreamingResponse(
                    self._stream(body, chat, include_usage), media_type="text/event-stream"
                )
            text = "".join(self.chunks)
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                if chat
                else {"index": 0, "text": text, "finish_reason": "stop"}
            )
            return JSONResponse(
                {
                    "id": f"cmpl-{self.name}-{len(self.requests)}",
                    "object": "chat.completion" if chat else "text_completion",
                    "created": 1,
                    "model": body.get("model"),
                    "system_fingerprint": self.name,
                    "choices": [choice],
                    "usage": self.usage,
                }
            )
        finally:
            self.in_flight -= 1

    async def _stream(self, body: dict, chat: bool, include_usage: bool):
        self.in_flight += 1
        try:
            for index, piece in enumerate(self.chunks):
                if self.die_after_chunks is not None and index >= self.die_after_chunks:
                    raise ConnectionAbortedError(f"{self.name} dies mid-stream")
                delta = {"delta": {"content": piece}} if chat else {"text": piece}
                chunk = {
                    "id": f"cmpl-{self.name}",
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "model": body.get("model"),
                    "system_fingerprint": self.name,
                    "choices": [{"index": 0, **delta, "finish_reason": None}],
                }
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
                if index == 0 and self.pause_after_first_chunk:
                    self._gate.clear()
                    await self._gate.wait()
            if include_usage:
                usage_chunk = {
                    "id": f"cmpl-{self.name}",
                    "model": body.get("model"),
                    "choices": [],
                    "usage": self.usage,
                }
                yield b"data: " + orjson.dumps(usage_chunk) + b"\n\n"
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.aborted += 1
            raise
        finally:
            self.in_flight -= 1


class _RecordAuthorization:
    """Notes the Authorization header of every request a FakeReplica receives, by path."""

    def __init__(self, app, replica: FakeReplica):
        self.app = app
        self.replica = replica

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            header = dict(scope["headers"]).get(b"authorization")
            self.replica.authorizations.setdefault(scope["path"], set()).add(header and header.decode())
        await self.app(scope, receive, send)


class EmberServe:
    """One `ember serve` process on a fixed port (so a restart comes back at the same URL). `host` and
    `prefix` place it elsewhere, e.g. in a network namespace (`ip netns exec NAME`, regions_harness)."""

    def __init__(
        self,
        model_dir: Path,
        name: str,
        max_num_seqs: int = 8,
        max_model_len: int = 512,
        host: str = "127.0.0.1",
        prefix: Sequence[str] = (),
    ):
        self.model_dir = model_dir
        self.name = name
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.host = host
        self.prefix = list(prefix)
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> EmberServe:
        self.launch()
        return self.wait_healthy()

    def launch(self) -> None:
        command = [
            *self.prefix, sys.executable, "-m", "ember.cli", "serve", "--model", str(self.model_dir), "--dtype", "float32",
            "--served-model-name", "tiny", "--host", self.host, "--port", str(self.port), "--num-threads", "1",
            "--max-num-seqs", str(self.max_num_seqs), "--max-model-len", str(self.max_model_len), "--log-level", "warning",
        ]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait_healthy(self) -> EmberServe:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ember serve {self.name} exited with {self.process.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"ember serve {self.name} did not become healthy")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()


class GatewayProcess:
    """One `ember gateway` process for a config file; `host` and `prefix` as for EmberServe."""

    def __init__(
        self,
        config_path: Path,
        log_path: Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        grpc: bool = True,
        prefix: Sequence[str] = (),
    ):
        self.port = port or free_port()
        self.grpc_port = free_port() if grpc else None
        self.url = f"http://{host}:{self.port}"
        command = [
            *prefix, sys.executable, "-m", "ember.cli", "gateway", "--config", str(config_path.resolve()),
            "--host", host, "--port", str(self.port),
        ]  # fmt: skip
        if self.grpc_port is not None:
            command += ["--grpc-port", str(self.grpc_port)]
        self.log_path = log_path
        self.log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        # In the config's folder: a gateway writes its defaults (./ember-jobs.db) where it runs.
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ), cwd=config_path.resolve().parent
        )

        def up() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"ember gateway exited: {log_path.read_text()[-2000:]}")
            try:
                return httpx.get(self.url + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, timeout_s=60, what="ember gateway to listen")

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        self.log.close()

    def stop(self) -> None:
        stop_process(self.process, 20)
        self.log.close()


class GatewayServer:
    def __init__(self, config: dict, base_dir: Path):
        self.config = parse_config(config, base_dir=base_dir)
        self.app: GatewayApp = create_app(self.config)
        self.server = ServerThread(self.app)
        self.url = self.server.url

    @property
    def dispatcher(self):
        return self.app.dispatcher

    def metric(self, name: str, **labels: str) -> float:
        value = self.dispatcher.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


def model_config(*replicas: FakeReplica, capacity: int = 8, **routing) -> dict:
    return {
        "routing": routing or {"policy": "least-outstanding"},
        "deployments": [
            {
                "name": "main",
                "replicas": [{"url": r.url, "id": r.name, "capacity": capacity} for r in replicas],
            }
        ],
    }


def inline_key(secret: str, **policy) -> dict:
    return {**policy, "sha256": sha256(secret)}


def gateway_config(models: dict, keys: list[dict], **extra) -> dict:
    config = {
        "models": models,
        "keys": {"inline": [inline_key(**key) for key in keys]},
        "health": {"interval_s": 0.2, "timeout_s": 0.5, "unhealthy_threshold": 2, "healthy_threshold": 1},
        "scrape": {"interval_s": 5},
    }
    config.update(extra)
    return config
