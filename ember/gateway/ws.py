"""GET /v1/ws: chat and completion requests over one WebSocket, several at a time.

Client frames (JSON text):
    {"type": "auth", "api_key": "sk-..."}                        unless the upgrade carried Authorization
    {"type": "chat.completions" | "completions", "id": "r1", "body": {...}, "priority": 1}   tier, higher first
    {"type": "cancel", "id": "r1"}
Server frames:
    {"type": "auth.ok"}
    {"type": "delta", "id": "r1", "data": <the OpenAI stream chunk>}        one per chunk, as they come
    {"type": "final", "id": "r1", "usage": {...}, "finish_reasons": ["stop"]}
    {"type": "cancelled", "id": "r1"}
    {"type": "error", "id": "r1" | null, "status": 429, "error": {"message", "type", "param", "code"},
     "headers": {"retry-after": "2", ...}}                                  headers only when there are any

Every request goes through the dispatcher (keys, limits, queue, routing) as a stream with usage.
A malformed frame, a frame over `limits.max_body_bytes` (status 413) or a failed request gets an error
frame; the socket stays open.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from ember.gateway.errors import GatewayError, bad_request
from ember.gateway.keys import Principal
from ember.gateway.request_body import parse_json_object

if TYPE_CHECKING:
    from ember.gateway.extensions import GatewayServices

REQUEST_TYPES = {"chat.completions": "chat/completions", "completions": "completions"}
MAX_IN_FLIGHT = 64


def frame_size(raw: str | bytes) -> int:
    """The frame's size in bytes (text frames travel as UTF-8)."""
    return len(raw) if isinstance(raw, bytes) or raw.isascii() else len(raw.encode())


def frame_too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"The frame is larger than {limit} bytes (limits.max_body_bytes).", code="request_too_large")


class WebSocketSession:
    def __init__(self, websocket: WebSocket, dispatcher: GatewayServices) -> None:
        self.websocket = websocket
        self.dispatcher = dispatcher
        self.principal: Principal | None = None
        self.in_flight: dict[str, asyncio.Task[None]] = {}
        self.max_frame_bytes = dispatcher.config.limits.max_body_bytes
        self._send_lock = asyncio.Lock()

    async def send(self, frame: dict[str, Any]) -> None:
        async with self._send_lock:
            await self.websocket.send_text(orjson.dumps(frame).decode())

    async def send_error(self, request_id: Any, exc: GatewayError) -> None:
        frame = {"type": "error", "id": request_id, "status": exc.status, **exc.to_dict()}
        if exc.headers:  # e.g. retry-after and x-ratelimit-* on a 429
            frame["headers"] = exc.headers
        await self.send(frame)

    async def run(self) -> None:
        authorization = self.websocket.headers.get("authorization")
        if authorization is not None:
            try:
                self.principal = self.dispatcher.authenticate(authorization)
            except GatewayError as exc:
                await self.send_error(None, exc)
                await self.websocket.close(code=1008, reason="authentication failed")
                return
        try:
            while True:
                message = await self.websocket.receive()
                if message["type"] == "websocket.disconnect":
                    return
                raw = message.get("text")
                if raw is None:
                    raw = message.get("bytes") or b""
                if frame_size(raw) > self.max_frame_bytes:
                    # Held to the HTTP body limit; the frame is not parsed, so the error carries no id.
                    await self.send_error(None, frame_too_large(self.max_frame_bytes))
                    continue
                await self.handle(raw)
        except WebSocketDisconnect:
            return
        finally:
            tasks = list(self.in_flight.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def handle(self, raw: str | bytes) -> None:
        try:
            frame = parse_json_object(raw, "A frame")
        except GatewayError as exc:
            exc.code = "invalid_frame"
            await self.send_error(None, exc)
            return
        request_id = frame.get("id")
        kind = frame.get("type")
        try:
            if kind == "auth":
                api_key = frame.get("api_key")
                if not isinstance(api_key, str) or not api_key:
                    raise bad_request("An auth frame needs 'api_key'.", param="api_key", code="invalid_frame")
                self.principal = self.dispatcher.authenticate(f"Bearer {api_key}")
                await self.send({"type": "auth.ok"})
            elif isinstance(kind, str) and kind in REQUEST_TYPES:  # a list or object type is unhashable
                self.start_request(request_id, REQUEST_TYPES[kind], frame)
            elif kind == "cancel":
                task = self.in_flight.get(request_id) if isinstance(request_id, str) else None
                if task is None:
                    raise bad_request(
                        f"No request in flight with id {request_id!r}.", "id", "unknown_request"
                    )
                task.cancel()
            else:
                raise bad_request(
                    f"Unknown frame type {kind!r}; expected auth, chat.completions, completions or cancel.",
                    param="type",
                    code="invalid_frame",
                )
        except GatewayError as exc:
            await self.send_error(request_id, exc)

    def start_request(self, request_id: Any, endpoint: str, frame: dict[str, Any]) -> None:
        if self.principal is None:
            raise GatewayError(
                401,
                "Authenticate first: send {'type': 'auth', 'api_key': ...} or an Authorization header.",
                code="missing_api_key",
            )
        if not isinstance(request_id, str) or not request_id:
            raise bad_request(
                "A request frame needs a non-empty string 'id'.", param="id", code="invalid_frame"
            )
        if request_id in self.in_flight:
            raise bad_request(f"A request with id {request_id!r} is already in flight.", "id", "duplicate_id")
        if len(self.in_flight) >= MAX_IN_FLIGHT:
            raise GatewayError(
                429,
                f"At most {MAX_IN_FLIGHT} requests may be in flight on one socket.",
                code="too_many_requests",
            )
        body = frame.get("body")
        if not isinstance(body, dict):
            raise bad_request("'body' must be a JSON object.", param="body", code="invalid_frame")
        priority = frame.get("priority")
        if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
            raise bad_request("'priority' must be an integer.", param="priority", code="invalid_frame")
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        task = asyncio.create_task(self.run_request(request_id, endpoint, body, priority, self.principal))
        self.in_flight[request_id] = task
        task.add_done_callback(lambda _: self.in_flight.pop(request_id, None))

    async def run_request(
        self, request_id: str, endpoint: str, body: dict[str, Any], priority: int | None, principal: Principal
    ) -> None:
        result = None
        try:
            result = await self.dispatcher.dispatch(principal, endpoint, body, priority=priority)
            if not result.stream:  # the replica refused the request before streaming
                payload = result.json()
                error = payload.get("error") if isinstance(payload, dict) else None
                error = error if isinstance(error, dict) else {"message": f"HTTP {result.status}"}
                message = str(error.get("message"))
                raise GatewayError(
                    result.status,
                    message,
                    error.get("type", "upstream_error"),
                    error.get("code"),
                    error.get("param"),
                )
            usage = None
            finish_reasons: dict[int, str] = {}
            async for payload in result.events():
                chunk = orjson.loads(payload)
                if "error" in chunk:
                    error = chunk["error"]
                    raise GatewayError(
                        502, error.get("message", "stream failed"), error.get("type", "server_error")
                    )
                usage = chunk.get("usage") or usage
                choices = chunk.get("choices") or []
                for choice in choices:
                    if choice.get("finish_reason") is not None:
                        finish_reasons[choice.get("index", 0)] = choice["finish_reason"]
                if choices:
                    await self.send({"type": "delta", "id": request_id, "data": chunk})
            await self.send(
                {
                    "type": "final",
                    "id": request_id,
                    "usage": usage,
                    "finish_reasons": [finish_reasons[index] for index in sorted(finish_reasons)],
                }
            )
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await self.send({"type": "cancelled", "id": request_id})
            raise
        except GatewayError as exc:
            with contextlib.suppress(Exception):
                await self.send_error(request_id, exc)
        except Exception as exc:  # noqa: BLE001 - one request's failure must not end the socket
            error = GatewayError(502, f"The request failed: {type(exc).__name__}: {exc}", "server_error")
            with contextlib.suppress(Exception):
                await self.send_error(request_id, error)
        finally:
            if result is not None:
                await result.aclose()


class WebSocketExtension:
    """Mounts /v1/ws on the gateway; sockets live and die with their connections."""

    def __init__(self, dispatcher: GatewayServices) -> None:
        self.dispatcher = dispatcher
        self.router = APIRouter()
        self.router.add_api_websocket_route("/v1/ws", self.endpoint)

    async def endpoint(self, websocket: WebSocket) -> None:
        await websocket.accept()
        await WebSocketSession(websocket, self.dispatcher).run()

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass
