"""A minimal HTTP/1.1 client for the proxy's hot path: keep-alive connection pools per replica,
one write per request, responses parsed by httptools (the parser uvicorn uses).

General-purpose clients spend most of the gateway's per-request CPU on features the proxy does not
use (cookies, redirects, proxies, auth, tracing hooks, multidict headers); this one does exactly:
POST a JSON body, get the status and headers, then the body at once or chunk by chunk as it
arrives (SSE is never buffered). Streams have backpressure: reading pauses while unread chunks
pile up. Timeouts: `connect_s` to open a connection, `read_s` for each wait on the replica.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from urllib.parse import urlsplit

import httptools

MAX_IDLE_PER_ORIGIN = 512
PAUSE_AT_CHUNKS = 64  # unread stream chunks before reading from the replica pauses


class UpstreamClosed(ConnectionResetError):
    """The replica closed the connection before the response was complete."""


class ConnectTimeout(ConnectionError):
    """No connection to the replica within `connect_s`: as good as unreachable."""


class _Origin:
    """Where one replica lives and the key it wants, with the request's fixed parts prebuilt."""

    __slots__ = ("host", "port", "ssl", "path_prefix", "host_header", "auth_line", "idle")

    def __init__(self, base_url: str, api_key: str | None):
        parts = urlsplit(base_url)
        self.host = parts.hostname or "127.0.0.1"
        secure = parts.scheme == "https"
        self.port = parts.port or (443 if secure else 80)
        self.ssl = ssl.create_default_context() if secure else None
        self.path_prefix = parts.path.rstrip("/").encode()
        self.host_header = (parts.netloc or self.host).encode()
        self.auth_line = f"Authorization: Bearer {api_key}\r\n".encode() if api_key else b""
        self.idle: collections.deque[_Connection] = collections.deque()


class _Connection(asyncio.Protocol):
    def __init__(self, loop: asyncio.AbstractEventLoop, read_s: float):
        self.loop = loop
        self.read_s = read_s
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.closed = False
        self.reused = False

    # --- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # bytes nobody asked for: the connection is unusable
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamClosed(f"invalid HTTP response from the replica: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self.response
        if response is not None and not response.complete:
            if response.headers_done and response.until_eof and exc is None:
                response._on_complete()
            else:
                self._fail(exc or UpstreamClosed("the replica closed the connection"))

    # --- httptools callbacks ----------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.response._header(name, value)

    def on_headers_complete(self) -> None:
        response = self.response
        response.status = self.parser.get_status_code()
        response.keep_alive = self.parser.should_keep_alive()
        response._on_headers()

    def on_body(self, body: bytes) -> None:
        self.response._on_body(body)

    def on_message_complete(self) -> None:
        self.response._on_complete()

    # --- use ------------------------------------------------------------------------------------

    def send(self, request: bytes, response: UpstreamResponse) -> None:
        self.response = response
        response._connection = self
        self.transport.write(request)

    def _fail(self, exc: BaseException) -> None:
        if self.response is not None:
            self.response._on_error(exc)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class UpstreamResponse:
    """The replica's response: `status` and `headers` (lower-case names) once `start()` returned,
    then `read()` for the whole body or `readany()` for the next chunk (b"" at the end)."""

    __slots__ = (
        "status", "headers", "keep_alive", "complete", "headers_done", "until_eof", "_connection",
        "_chunks", "_waiter", "_error", "_timer", "_paused", "_client", "_origin",
    )  # fmt: skip

    def __init__(self, client: HttpClient, origin: _Origin):
        self.status = 0
        self.headers: dict[str, str] = {}
        self.keep_alive = False
        self.complete = False
        self.headers_done = False
        self.until_eof = True  # no content-length and not chunked: the body ends with the connection
        self._connection: _Connection | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._error: BaseException | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._paused = False
        self._client = client
        self._origin = origin

    # --- fed by the connection ------------------------------------------------------------------

    def _header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        self.headers[key] = value.decode("latin-1")
        if key == "content-length" or (key == "transfer-encoding" and b"chunked" in value.lower()):
            self.until_eof = False

    def _on_headers(self) -> None:
        self.headers_done = True
        self._wake()

    def _on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        if len(self._chunks) >= PAUSE_AT_CHUNKS and not self._paused:
            self._paused = True
            self._connection.transport.pause_reading()
        self._wake()

    def _on_complete(self) -> None:
        self.complete = True
        self._wake()

    def _on_error(self, exc: BaseException) -> None:
        self._error = exc
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        loop = self._connection.loop
        self._waiter = loop.create_future()
        self._timer = loop.call_later(self._connection.read_s, self._on_timeout, self._waiter)
        try:
            await self._waiter
        finally:
            self._timer.cancel()
            self._waiter = None
        if self._error is not None:
            raise self._error

    @staticmethod
    def _on_timeout(waiter: asyncio.Future) -> None:
        if not waiter.done():
            waiter.set_exception(TimeoutError("timed out waiting for the replica"))

    # --- the consumer's side --------------------------------------------------------------------

    async def start(self) -> None:
        while not self.headers_done:
            await self._wait()

    async def read(self) -> bytes:
        while not self.complete:
            await self._wait()
        body = b"".join(self._chunks)
        self._chunks.clear()
        self.release()
        return body

    async def readany(self) -> bytes:
        while not self._chunks:
            if self.complete:
                return b""
            await self._wait()
        if len(self._chunks) == 1:
            chunk = self._chunks.popleft()
        else:
            chunk = b"".join(self._chunks)
            self._chunks.clear()
        if self._paused:
            self._paused = False
            self._connection.transport.resume_reading()
        return chunk

    def release(self) -> None:
        """Done with the response: a complete keep-alive connection goes back to the pool."""
        connection, self._connection = self._connection, None
        if connection is None:
            return
        connection.response = None
        if self.complete and self.keep_alive and not connection.closed and self._error is None:
            self._client._put_idle(self._origin, connection)
        else:
            connection.close()

    def fail(self, reason: str) -> None:
        """Give up on the replica: the pending and every later read raises UpstreamClosed(reason)."""
        self._on_error(UpstreamClosed(reason))

    def close(self) -> None:
        """Abandon the response (the replica sees the disconnect and can stop generating)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.response = None
            connection.close()


class HttpClient:
    def __init__(self, connect_s: float, read_s: float):
        self.connect_s = connect_s
        self.read_s = read_s
        self._origins: dict[tuple[str, str | None], _Origin] = {}

    async def post_json(
        self, base_url: str, path: bytes, body: bytes, api_key: str | None = None
    ) -> UpstreamResponse:
        """POST `body` to base_url + path (with `Authorization: Bearer <api_key>` when given); returns
        once the response headers arrived."""
        origin = self._origins.get((base_url, api_key))
        if origin is None:
            origin = self._origins[base_url, api_key] = _Origin(base_url, api_key)
        request = b"".join((
            b"POST ", origin.path_prefix, path, b" HTTP/1.1\r\nHost: ", origin.host_header, b"\r\n",
            origin.auth_line, b"Content-Type: application/json\r\nContent-Length: ", str(len(body)).encode(),
            b"\r\n\r\n", body,
        ))  # fmt: skip
        while True:
            connection = await self._connection(origin)
            response = UpstreamResponse(self, origin)
            connection.send(request, response)
            try:
                await response.start()
                return response
            except ConnectionError:
                response.close()
                # A kept-alive connection the replica closed while idle: not the replica's failure.
                if connection.reused:
                    continue
                raise
            except BaseException:
                response.close()
                raise

    async def _connection(self, origin: _Origin) -> _Connection:
        idle = origin.idle
        while idle:
            connection = idle.pop()
            if not connection.closed and not connection.transport.is_closing():
                connection.reused = True
                return connection
        loop = asyncio.get_running_loop()
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Connection(loop, self.read_s), origin.host, origin.port,
                    ssl=origin.ssl, server_hostname=origin.host if origin.ssl else None,
                ),
                self.connect_s,
            )  # fmt: skip
        except TimeoutError:
            raise ConnectTimeout(
                f"no connection to {origin.host}:{origin.port} within {self.connect_s} s"
            ) from None
        return connection

    def _put_idle(self, origin: _Origin, connection: _Connection) -> None:
        connection.parser = httptools.HttpResponseParser(connection)
        if len(origin.idle) < MAX_IDLE_PER_ORIGIN:
            origin.idle.append(connection)
        else:
            connection.close()

    def close(self) -> None:
        for origin in self._origins.values():
            while origin.idle:
                origin.idle.pop().close()
        self._origins.clear()
