"""Drive a workload against a server: arrivals, the concurrency cap, warmups, progress and Ctrl-C.

Each conversation is one task; its turns go out one after another because every later turn carries the
server's earlier replies. --max-concurrency caps requests in flight, not conversations."""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from tqdm import tqdm

from ember.bench import API_PATHS
from ember.bench.arrivals import arrival_offsets
from ember.bench.client import RequestResult, stream_request
from ember.bench.datasets import Conversation, Turn
from ember.bench.metrics import RequestRecord


@dataclass
class RunSettings:
    base_url: str
    model: str
    api: str = "completions"  # completions | chat
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = True
    request_timeout: float = 600.0
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    show_progress: bool = True


@dataclass
class RunOutcome:
    records: list[RequestRecord]
    start: float  # perf_counter when the first measured request could go out
    duration: float
    interrupted: bool = False
    cancelled: int = 0  # requests in flight when Ctrl-C stopped the run (not counted anywhere else)
    skipped_turns: int = 0  # later turns of sessions whose earlier turn failed


def build_payload(settings: RunSettings, history: list[dict[str, str]], prior_text: str,
                  turn: Turn) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": settings.model,
        "temperature": settings.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if settings.api == "chat":
        payload["messages"] = [*history, {"role": "user", "content": turn.text}]
        payload["max_completion_tokens"] = turn.output_len
    else:
        payload["prompt"] = prior_text + turn.text
        payload["max_tokens"] = turn.output_len
    if settings.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(settings.extra_body)
    return payload


def make_client(settings: RunSettings) -> aiohttp.ClientSession:
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    return aiohttp.ClientSession(
        headers=headers,
        # request_timeout bounds the connect and every wait for more of the response, not the whole stream.
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=min(settings.request_timeout, 30.0),
                                      sock_read=settings.request_timeout),
        # A connection per request: a kept-alive connection that the server closes as the next request
        # goes out fails that request before the server sees it (llama.cpp's llama-server did so for 12
        # of 64 requests at c=8). Connecting over loopback costs microseconds.
        connector=aiohttp.TCPConnector(limit=0, force_close=True),
        # Benchmarks talk to a known address; proxies from the environment would distort timings.
        trust_env=False,
    )


class _Runner:
    def __init__(self, settings: RunSettings, client: aiohttp.ClientSession, progress: tqdm) -> None:
        self.settings = settings
        self.client = client
        self.progress = progress
        self.url = settings.base_url.rstrip("/") + API_PATHS[settings.api]
        self.records: list[RequestRecord] = []
        self.in_flight = 0
        self.skipped_turns = 0
        self.semaphore = asyncio.Semaphore(settings.max_concurrency) if settings.max_concurrency else None

    async def _send(self, payload: dict[str, Any]) -> RequestResult:
        async with self.semaphore or contextlib.nullcontext():
            self.in_flight += 1
            try:
                return await stream_request(self.client, self.url, payload)
            finally:
                self.in_flight -= 1

    async def conversation(self, conversation: Conversation) -> None:
        history: list[dict[str, str]] = []
        prior_text = ""
        prior_tokens = 0
        for index, turn in enumerate(conversation.turns):
            result = await self._send(build_payload(self.settings, history, prior_text, turn))
            self.records.append(RequestRecord(result, prompt_len=prior_tokens + turn.prompt_len))
            self.progress.update(1)
            if not result.success:
                remaining = len(conversation.turns) - index - 1
                self.skipped_turns += remaining
                self.progress.update(remaining)
                return
            history += [{"role": "user", "content": turn.text},
                        {"role": "assistant", "content": result.generated_text}]
            prior_text += turn.text + result.generated_text
            prior_tokens += turn.prompt_len + (result.output_tokens or len(result.chunk_times))


async def _run_all(runner: _Runner, conversations: list[Conversation], offsets: list[float],
                   start: float) -> None:
    tasks = []
    try:
        for conversation, offset in zip(conversations, offsets, strict=True):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(runner.conversation(conversation)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


async def run_warmups(settings: RunSettings, conversations: list[Conversation]) -> list[RequestResult]:
    """Requests sent before the measurement (their own prompts, so no measured prompt is cached)."""
    if not conversations:
        return []
    async with make_client(settings) as client:
        runner = _Runner(settings, client, tqdm(disable=True))
        await asyncio.gather(*(runner.conversation(c) for c in conversations))
    return [r.result for r in runner.records]


async def run_benchmark(
    settings: RunSettings, conversations: list[Conversation], offsets: list[float] | None = None
) -> RunOutcome:
    """Send every conversation at its arrival time; Ctrl-C (SIGINT) stops the run and keeps what finished.
    `offsets`: each conversation's arrival (seconds after the start) from a trace, instead of the
    settings' rate and burstiness."""
    if offsets is None:
        offsets = arrival_offsets(len(conversations), settings.request_rate, settings.burstiness, settings.seed)
    total_requests = sum(len(c.turns) for c in conversations)
    loop = asyncio.get_running_loop()
    interrupted = False
    cancelled = 0
    with tqdm(total=total_requests, disable=not settings.show_progress, file=sys.stderr,
              unit="req", dynamic_ncols=True) as progress:
        async with make_client(settings) as client:
            runner = _Runner(settings, client, progress)
            start = time.perf_counter()
            main = asyncio.create_task(_run_all(runner, conversations, offsets, start))

            def on_sigint() -> None:
                nonlocal interrupted, cancelled
                interrupted = True
                cancelled = runner.in_flight
                main.cancel()

            try:
                loop.add_signal_handler(signal.SIGINT, on_sigint)
                handles_sigint = True
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or Windows
                handles_sigint = False
            try:
                await main
            except asyncio.CancelledError:
                if not interrupted:
                    raise
            finally:
                if handles_sigint:
                    loop.remove_signal_handler(signal.SIGINT)
            duration = time.perf_counter() - start
    return RunOutcome(records=runner.records, start=start, duration=duration, interrupted=interrupted,
                      cancelled=cancelled, skipped_turns=runner.skipped_turns)
