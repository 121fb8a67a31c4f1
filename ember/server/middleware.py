"""Pure ASGI middleware around every request: access log, request-body size limit, API key, JSON
Content-Type.

Pure ASGI (not BaseHTTPMiddleware) so a streamed response's chunks pass through without extra tasks."""

from __future__ import annotations

import hmac
import logging
import time
import uuid

import orjson
from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember.http_rules import (
    UNSUPPORTED_MEDIA_TYPE,
    UNSUPPORTED_MEDIA_TYPE_CODE,
    is_json_content_type,
    parse_bearer,
    unsupported_media_type_message,
)
from ember.server.errors import APIError

access_logger = logging.getLogger("ember.access")

ACCESS_RECORD_KEY = "ember.access"
# Probes and scrapes would drown the access log; they are logged at DEBUG only.
QUIET_PATHS = frozenset({"/health", "/ready", "/metrics"})


class AccessRecord:
    """What the serving code learns about a request, for its access-log line."""

    __slots__ = (
        "request_id",
        "completion_id",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "ttft",
        "finish_reason",
    )

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.completion_id: str | None = None
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.ttft: float | None = None
        self.finish_reason: str | None = None


def access_record(scope: Scope) -> AccessRecord:
    record = scope.get(ACCESS_RECORD_KEY)
    if record is None:  # a request that did not pass through AccessLog (tests mounting the app bare)
        record = scope[ACCESS_RECORD_KEY] = AccessRecord(uuid.uuid4().hex)
    return record


class AccessLog:
    """Assigns the request id (X-Request-Id, echoed back) and logs one JSON line per request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        request_id = _header(scope, b"x-request-id") or uuid.uuid4().hex
        record = scope[ACCESS_RECORD_KEY] = AccessRecord(request_id)
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            level = logging.DEBUG if scope["path"] in QUIET_PATHS else logging.INFO
            if access_logger.isEnabledFor(level):
                line = {
                    "request_id": record.request_id,
                    "id": record.completion_id,
                    "method": scope["method"],
                    "path": scope["path"],
                    "status": status,
                    "prompt_tokens": record.prompt_tokens,
                    "completion_tokens": record.completion_tokens,
                    "cached_tokens": record.cached_tokens,
                    "finish_reason": record.finish_reason,
                    "ttft_s": None if record.ttft is None else round(record.ttft, 4),
                    "total_s": round(time.perf_counter() - start, 4),
                }
                access_logger.log(level, orjson.dumps(line).decode())


class BodySizeLimit:
    """413 for a request body over `max_bytes`, from Content-Length or while a chunked body streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large().response()(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI re-raises HTTPException from body parsing; the error handlers shape it.
                    raise HTTPException(413, detail=self._too_large().message)
            return message

        await self.app(scope, counting_receive, send)

    def _too_large(self) -> APIError:
        return APIError(
            413, f"Request body too large: the limit is {self.max_bytes} bytes", code="request_too_large"
        )


class APIKeyAuth:
    """Requires `Authorization: Bearer <key>` (ember.http_rules) on the API paths, and on /metrics with
    `protect_metrics`; compared in constant time."""

    PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")

    def __init__(self, app: ASGIApp, api_key: str, protect_metrics: bool = False) -> None:
        self.app = app
        self._expected = api_key.encode()
        self._prefixes = self.PROTECTED_PREFIXES + (("/metrics",) if protect_metrics else ())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self._prefixes):
            provided = (parse_bearer(_header(scope, b"authorization")) or "").encode()
            if not hmac.compare_digest(provided, self._expected):
                error = APIError(
                    401,
                    "Invalid or missing API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class JSONContentType:
    """415 for a POST to a JSON route whose Content-Type is not JSON (ember.http_rules); a body sent
    without Content-Type is labelled JSON for the routes (FastAPI would not parse it)."""

    def __init__(self, app: ASGIApp, paths: frozenset[str]) -> None:
        self.app = app
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.paths:
            content_type = _header(scope, b"content-type")
            if not is_json_content_type(content_type):
                error = APIError(
                    UNSUPPORTED_MEDIA_TYPE,
                    unsupported_media_type_message(content_type),
                    code=UNSUPPORTED_MEDIA_TYPE_CODE,
                    error_type="invalid_request_error",
                )
                await error.response()(scope, receive, send)
                return
            if content_type is None:
                scope = {**scope, "headers": [*scope["headers"], (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None
