"""Talking to replicas: one pooled HTTP client, the classification of upstream failures (retryable
before the first byte or not), and `UpstreamResult`, the response handed to every protocol.

Streams are passed through event by event as the replica produces them (never buffered); a
failure after the first event ends the stream with an error event, never a hang.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable

import httpx
import orjson

from ember.gateway.config import TimeoutsConfig
from ember.gateway.http_client import ConnectTimeout, HttpClient, UpstreamResponse
from ember.gateway.replicas import Replica
from ember.side_client import side_client
from ember.sse import DONE_DATA

logger = logging.getLogger("ember.gateway")

ENDPOINT_PATHS = {"chat/completions": b"/v1/chat/completions", "completions": b"/v1/completions"}


class UpstreamFailure(Exception):
    """The replica failed before anything reached the client: the request may go to another one.
    `eject_now`: the failure shows the replica is unreachable (passive ejection)."""

    def __init__(
        self, reason: str, detail: str, eject_now: bool, status: int | None = None, body: bytes = b""
    ):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.eject_now = eject_now
        self.status = status
        self.body = body


def classify(exc: Exception) -> UpstreamFailure:
    """Map an exception met while talking to a replica to a failure with a short reason (a metrics
    label). Every exception is one: whatever fails before the first byte reached the client (an OSError
    or anything else the client or event loop raises) is retried on another replica, never a 500."""
    if isinstance(exc, TimeoutError):
        return UpstreamFailure("timeout", "timed out waiting for the replica", eject_now=False)
    if isinstance(exc, ConnectionRefusedError | ConnectTimeout):
        return UpstreamFailure("connect_error", f"cannot connect: {exc}", eject_now=True)
    if isinstance(exc, ConnectionError):
        return UpstreamFailure(
            "disconnected", f"connection lost: {exc or type(exc).__name__}", eject_now=True
        )
    if isinstance(exc, OSError):
        return UpstreamFailure("connect_error", f"cannot connect: {exc}", eject_now=True)
    logger.warning("unexpected error talking to a replica (counted as its failure)", exc_info=exc)
    return UpstreamFailure("error", f"{type(exc).__name__}: {exc}", eject_now=False)


class UpstreamClient:
    """Long-lived connection pools to all replicas: the lean HttpClient for proxied requests, the
    side client (ember/side_client.py) for the low-rate side traffic (health probes, metrics scrapes)."""

    def __init__(self, timeouts: TimeoutsConfig):
        self.timeouts = timeouts
        self._side: httpx.AsyncClient | None = None
        self._http = HttpClient(timeouts.connect_s, timeouts.read_s)

    async def start(self) -> None:
        self._side = side_client(self.timeouts.read_s, connect_s=self.timeouts.connect_s)

    async def close(self) -> None:
        self._http.close()
        if self._side is not None:
            await self._side.aclose()
            self._side = None

    @property
    def side(self) -> httpx.AsyncClient:
        if self._side is None:
            raise RuntimeError("UpstreamClient.start() was not awaited")
        return self._side

    async def post(self, replica: Replica, endpoint: str, body: bytes) -> UpstreamResponse:
        """Send the request; response headers received. Raises UpstreamFailure."""
        try:
            return await self._http.post_json(replica.url, ENDPOINT_PATHS[endpoint], body, replica.api_key)
        except Exception as exc:
            raise classify(exc) from None


class SSEParser:
    """Incremental Server-Sent Events parser: feed bytes, get the `data` payload of each complete event."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        buffer = self._buffer + chunk
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
        *events, self._buffer = buffer.split(b"\n\n")
        payloads = []
        for event in events:
            data = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
            if data:
                payloads.append(b"\n".join(data))
        return payloads


def usage_of(payload: bytes) -> dict | None:
    """The `usage` object of a response body or stream chunk, parsed only when one is present."""
    if b'"usage"' not in payload or b'"usage":null' in payload:
        return None
    try:
        usage = orjson.loads(payload).get("usage")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None


def stream_error_payload(message: str) -> bytes:
    return orjson.dumps(
        {
            "error": {
                "message": message,
                "type": "server_error",
                "param": None,
                "code": "upstream_stream_error",
            }
        }
    )


Finisher = Callable[["UpstreamResult", str, "dict | None"], None]


class UpstreamResult:
    """A replica's answer. Non-streamed: `status`, `headers`, `body`/`json()`, already complete.
    Streamed: `async for payload in events()` yields each SSE `data` payload (bytes, without the
    `data: ` framing and without the final `[DONE]`); a failure mid-stream yields one OpenAI-shaped
    error payload and ends. Always `await aclose()` (idempotent) to release the replica."""

    def __init__(
        self,
        replica: Replica,
        status: int,
        headers: dict[str, str],
        *,
        body: bytes = b"",
        response: UpstreamResponse | None = None,
        parser: SSEParser | None = None,
        pending: list[bytes] | None = None,
        strip_usage_chunk: bool = False,
        finisher: Finisher | None = None,
    ):
        self.replica = replica
        self.status = status
        self.headers = headers
        self.body = body
        self.stream = response is not None
        self._response = response
        self._parser = parser
        self._pending = pending or []
        self._strip_usage_chunk = strip_usage_chunk
        self._finisher = finisher
        self.usage: dict | None = None if response is not None else usage_of(body)
        self.failure: UpstreamFailure | None = None
        self.last_data_at = time.monotonic()  # a stream's last bytes from the replica (stalled_streams.py)

    def json(self) -> dict:
        return orjson.loads(self.body)

    async def events(self) -> AsyncIterator[bytes]:
        if self._response is None:
            raise RuntimeError("events() is only for streamed results; use json()")
        outcome = "cancelled"  # the consumer stopped early (client disconnect) unless set below
        try:
            pending, self._pending = self._pending, []
            for payload in pending:
                if payload == DONE_DATA:
                    outcome = "ok"
                    return
                if self._keep(payload):
                    yield payload
            response = self._response
            while True:
                try:
                    chunk = await response.readany()
                except Exception as exc:
                    self.failure = classify(exc)
                    outcome = "error"
                    yield stream_error_payload(f"The replica failed mid-stream ({self.failure.detail}).")
                    return
                self.last_data_at = time.monotonic()
                if not chunk:
                    self.failure = UpstreamFailure(
                        "disconnected", "stream ended without [DONE]", eject_now=False
                    )
                    outcome = "error"
                    yield stream_error_payload("The replica closed the stream before it was complete.")
                    return
                for payload in self._parser.feed(chunk):
                    if payload == DONE_DATA:
                        outcome = "ok"
                        return
                    if self._keep(payload):
                        yield payload
        finally:
            self._finish(outcome)

    def _keep(self, payload: bytes) -> bool:
        """Record usage; drop the usage-only chunk the gateway asked for when the client did not."""
        usage = usage_of(payload)
        if usage is None:
            return True
        self.usage = usage
        return not (self._strip_usage_chunk and b'"choices":[]' in payload.replace(b" ", b""))

    async def aclose(self) -> None:
        self._finish("cancelled")

    def abort(self, reason: str) -> None:
        """End a stream the replica stopped feeding: its reader gets an error event and ends."""
        if self._response is not None:
            self._response.fail(reason)

    def _finish(self, outcome: str) -> None:
        if self._response is not None:
            if outcome == "ok":
                self._response.release()  # the connection goes back to the pool
            else:
                self._response.close()  # aborts the replica's generation (it sees the disconnect)
        finisher, self._finisher = self._finisher, None
        if finisher is not None:
            finisher(self, outcome, self.usage)


async def read_first_events(response: UpstreamResponse, parser: SSEParser) -> list[bytes]:
    """Read until at least one complete event arrives (still retryable until it does)."""
    while True:
        try:
            chunk = await response.readany()
        except Exception as exc:
            raise classify(exc) from None
        if not chunk:
            raise UpstreamFailure("disconnected", "stream ended before its first event", eject_now=False)
        payloads = parser.feed(chunk)
        if payloads:
            return payloads


async def read_body(response: UpstreamResponse) -> bytes:
    try:
        return await response.read()
    except Exception as exc:
        response.close()
        raise classify(exc) from None
