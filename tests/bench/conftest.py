"""A scripted OpenAI-compatible SSE server on loopback with known timings, for the bench client tests.

Each streamed request gets its first content chunk FIRST_CHUNK_S after it arrives, then one content chunk
(one token) every CHUNK_INTERVAL_S, then a finish chunk, a usage chunk and [DONE]. Chunks are scheduled
at absolute times from the request's arrival, so scheduling jitter does not accumulate."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import tokenizers
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

FIRST_CHUNK_S = 0.200
CHUNK_INTERVAL_S = 0.050
MODEL_NAME = "scripted-model"


@dataclass
class Script:
    """What the server does; tests change it before a run."""

    fail_every: int = 0  # every Nth request (1-based) answers 500
    first_chunk_s: float = FIRST_CHUNK_S
    send_usage: bool = True
    sigint_on_request: int = 0  # send SIGINT to this process when this request (1-based) arrives
    requests: list[dict[str, Any]] = field(default_factory=list)  # bodies received, in order
    client_ports: list[int] = field(default_factory=list)  # client port of each /v1/completions request


class ScriptedServer:
    def __init__(self, tokenizer: tokenizers.Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.script = Script()
        self.lock = threading.Lock()
        self.app = Starlette(routes=[
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
        ])
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("scripted server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": MODEL_NAME, "object": "model"}]})

    async def completions(self, request: Request):
        body = await request.json()
        self.script.client_ports.append(request.client.port)
        return await self._respond(body, len(self.tokenizer.encode(body["prompt"]).ids), chat=False)

    async def chat(self, request: Request):
        body = await request.json()
        text = "".join(m["content"] for m in body["messages"])
        return await self._respond(body, len(self.tokenizer.encode(text).ids), chat=True)

    async def _respond(self, body: dict[str, Any], prompt_tokens: int, chat: bool):
        arrival = time.perf_counter()
        script = self.script
        with self.lock:
            script.requests.append(body)
            number = len(script.requests)
        if script.sigint_on_request == number:
            os.kill(os.getpid(), signal.SIGINT)
        if script.fail_every and number % script.fail_every == 0:
            return JSONResponse({"error": {"message": "scripted failure", "type": "server_error",
                                           "param": None, "code": None}}, status_code=500)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")

        def chunk(text: str | None, finish: str | None = None) -> str:
            if chat:
                choice = {"index": 0, "delta": {} if text is None else {"content": text},
                          "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish}
            return f"data: {json.dumps({'id': 'x', 'choices': [choice]})}\n\n"

        async def events():
            if chat:
                yield f"data: {json.dumps({'id': 'x', 'choices': [{'index': 0, 'delta': {'role': 'assistant'}}]})}\n\n"
            for i in range(max_tokens):
                delay = arrival + script.first_chunk_s + i * CHUNK_INTERVAL_S - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                yield chunk(f" tok{i}")
            yield chunk(None, "length")
            if script.send_usage:
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                         "total_tokens": prompt_tokens + max_tokens}
                yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="session")
def bench_tokenizer_file(tiny_model_dir: Path) -> Path:
    return Path(tiny_model_dir) / "tokenizer.json"


@pytest.fixture(scope="session")
def _scripted_server(bench_tokenizer_file: Path):
    server = ScriptedServer(tokenizers.Tokenizer.from_file(str(bench_tokenizer_file)))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def scripted_server(_scripted_server: ScriptedServer) -> ScriptedServer:
    """The session's server with a fresh script for each test."""
    _scripted_server.script = Script()
    return _scripted_server
