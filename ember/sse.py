"""Server-sent events as every OpenAI-compatible stream frames them: one `data: <json>` event per
chunk and a final `data: [DONE]`. Shared by the server (writes), the gateway (reads and writes)
and bench (reads), so the three agree byte for byte."""

from __future__ import annotations

DONE_DATA = b"[DONE]"
DONE_EVENT = b"data: " + DONE_DATA + b"\n\n"
CONTENT_TYPE = "text/event-stream; charset=utf-8"
# Proxies (nginx) must pass each event on at once rather than buffer the response.
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def data_event(data: bytes) -> bytes:
    """One SSE event carrying `data` (a JSON document without newlines)."""
    return b"data: " + data + b"\n\n"
