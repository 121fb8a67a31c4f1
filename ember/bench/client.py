"""One streamed request against an OpenAI-compatible server, timed on the client per SSE chunk.

Timing follows `vllm bench serve`: TTFT is the first content chunk minus the send time, every later gap
between content chunks is an inter-token latency, and the end-to-end latency ends at the last content
chunk. A content chunk is one whose choice carries non-empty text (the role-only first chunk of a chat
stream and the final finish_reason/usage chunks carry none).

aiohttp and orjson, like vLLM's client: the client shares the machine with the server it measures, and on
two cores every millisecond it spends per chunk is taken from the server (with httpx's pure-Python stream
parsing, ember's c=32 output rate read ~10% lower than under `vllm bench serve`)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from ember.sse import DONE_DATA


@dataclass
class RequestResult:
    start_time: float  # time.perf_counter() at send
    success: bool = False
    status: int | None = None  # HTTP status; None when no response came (refused, timeout)
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0  # send -> last content chunk
    itl: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # perf_counter of each content chunk
    generated_text: str = ""
    output_tokens: int | None = None  # usage.completion_tokens when the server sends usage
    prompt_tokens: int | None = None  # usage.prompt_tokens
    end_time: float = 0.0  # perf_counter when the response was fully read or failed

    @property
    def error_key(self) -> str:
        return f"{self.status if self.status is not None else 'no response'}: {self.error}"


def _error_message(body: bytes) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:200] or "(empty body)"
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])[:200]
    if isinstance(data, dict) and data.get("detail"):
        return str(data["detail"])[:200]
    return json.dumps(data)[:200]


def _chunk_text(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


async def _sse_data(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The `data:` payloads of an SSE stream, up to `[DONE]`, as the bytes arrive."""
    pending = b""
    async for piece in content.iter_any():
        *lines, pending = (pending + piece).split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                data = line[5:].strip()
                if data == DONE_DATA:
                    return
                yield data


async def stream_request(session: aiohttp.ClientSession, url: str, payload: dict[str, Any]) -> RequestResult:
    """POST `payload` with stream=true and time every content chunk. Never raises for server failures:
    they come back as `success=False` with the status and message."""
    result = RequestResult(start_time=time.perf_counter())
    last_chunk_time = result.start_time
    try:
        async with session.post(url, json=payload) as response:
            result.status = response.status
            if response.status != 200:
                result.error = _error_message(await response.read())
                return result
            async for data in _sse_data(response.content):
                try:
                    chunk = orjson.loads(data)
                except orjson.JSONDecodeError:
                    result.error = f"malformed SSE data: {data[:100].decode('utf-8', 'replace')}"
                    return result
                if chunk.get("error"):
                    error = chunk["error"]
                    result.error = str(error.get("message") if isinstance(error, dict) else error)[:200]
                    return result
                usage = chunk.get("usage")
                if usage:
                    result.output_tokens = usage.get("completion_tokens")
                    result.prompt_tokens = usage.get("prompt_tokens")
                choices = chunk.get("choices")
                text = _chunk_text(choices[0]) if choices else ""
                if not text:
                    continue
                now = time.perf_counter()
                if result.chunk_times:
                    result.itl.append(now - last_chunk_time)
                else:
                    result.ttft = now - result.start_time
                last_chunk_time = now
                result.chunk_times.append(now)
                result.generated_text += text
        if not result.chunk_times:
            result.error = "the stream ended without any content chunk"
            return result
        result.success = True
        result.latency = last_chunk_time - result.start_time
    except TimeoutError as exc:  # aiohttp's connect and read timeouts are TimeoutErrors
        result.error = f"timeout ({type(exc).__name__})"
    except aiohttp.ClientError as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        result.end_time = time.perf_counter()
    return result
