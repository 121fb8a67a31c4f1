"""A fast OpenAI-compatible stub upstream for measuring the gateway's own overhead.

    python benchmarks/gateway/stub_upstream.py --port 9101 [--tokens 16 --token-interval-ms 20]

Non-streamed requests get a fixed small chat completion at once; streamed ones get `--tokens` chunks,
the first immediately and the rest `--token-interval-ms` apart. Raw ASGI on uvicorn + uvloop +
httptools, so the stub costs as little CPU as possible next to the gateway on a 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio

import orjson
import uvicorn

COMPLETION = orjson.dumps(
    {
        "id": "chatcmpl-stub",
        "object": "chat.completion",
        "created": 1,
        "model": "stub",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11},
    }
)
CHUNK = b"data: " + orjson.dumps(
    {
        "id": "chatcmpl-stub",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "stub",
        "choices": [{"index": 0, "delta": {"content": "tok"}, "finish_reason": None}],
    }
) + b"\n\n"
USAGE = b"data: " + orjson.dumps(
    {"id": "chatcmpl-stub", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 16, "total_tokens": 25}}
) + b"\n\n"
JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream")]


def build_app(tokens: int, interval_s: float):
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if scope["path"] in ("/health", "/metrics"):
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b""})
            return
        if b'"stream":true' not in body.replace(b" ", b""):
            await send({"type": "http.response.start", "status": 200, "headers": JSON_HEADERS})
            await send({"type": "http.response.body", "body": COMPLETION})
            return
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        for index in range(tokens):
            if index:
                await asyncio.sleep(interval_s)
            await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
        if b'"include_usage":true' in body.replace(b" ", b""):
            await send({"type": "http.response.body", "body": USAGE, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=9101, help="port to listen on")
    parser.add_argument("--tokens", type=int, default=16, help="chunks per streamed response")
    parser.add_argument("--token-interval-ms", type=float, default=20.0, help="gap between streamed chunks")
    args = parser.parse_args()
    uvicorn.run(
        build_app(args.tokens, args.token_interval_ms / 1000), host=args.host, port=args.port,
        loop="uvloop", http="httptools", log_level="warning", access_log=False,
    )  # fmt: skip


if __name__ == "__main__":
    main()
