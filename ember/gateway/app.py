"""The gateway's HTTP application: `create_app(config) -> ASGI app`.

The two proxy routes (/v1/chat/completions, /v1/completions) are the hot path and are served by a
lean raw-ASGI handler (JSON parsed once with orjson, the body forwarded as received when possible,
SSE written event by event). Everything else (/v1/models, /v1/usage, /health, /ready, /metrics,
/admin/*, and routes that extensions such as async jobs add) is an ordinary FastAPI app behind it.
Errors use OpenAI's shape everywhere, an unexpected exception's too (a 500 whose traceback goes to the log).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import asyncpg
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ember import sse
from ember.errors import ClientDisconnected
from ember.gateway.admin import build_admin_router, require_admin
from ember.gateway.config import GatewayConfig
from ember.gateway.console.routes import build_console_router
from ember.gateway.dispatch import Dispatcher
from ember.gateway.errors import GatewayError, bad_request, internal_error
from ember.gateway.proxy import UpstreamResult
from ember.gateway.request_body import parse_json_object
from ember.gateway.shared.connection import state_unavailable
from ember.http_rules import (
    UNSUPPORTED_MEDIA_TYPE,
    UNSUPPORTED_MEDIA_TYPE_CODE,
    is_json_content_type,
    unsupported_media_type_message,
)

if TYPE_CHECKING:
    from ember.gateway.extensions import ExtensionFactory, GatewayExtension

logger = logging.getLogger("ember.gateway")

PROXY_ROUTES = {b"/v1/chat/completions": "chat/completions", b"/v1/completions": "completions"}
# POST routes of the FastAPI side whose body is JSON (/v1/files takes a multipart upload).
JSON_POST_PREFIXES = ("/v1/async/", "/v1/batches", "/admin/")
SSE_HEADERS = [(b"content-type", sse.CONTENT_TYPE.encode())] + [
    (name.lower().encode(), value.encode()) for name, value in sse.HEADERS.items()
]
KEEPALIVE_EVENT = b": waiting for a replica to start\n\n"  # an SSE comment: clients skip it
HELD_KEEPALIVE_S = 5.0
WATCH_AFTER_S = 0.02


def error_response(exc: GatewayError) -> JSONResponse:
    return JSONResponse(exc.to_dict(), status_code=exc.status, headers=exc.headers)


class GatewayApp:
    """Raw ASGI entry: lifespan, the proxy routes, and delegation of everything else."""

    def __init__(self, config: GatewayConfig, extension_factories: Sequence[ExtensionFactory] = ()):
        self.config = config
        self.dispatcher = Dispatcher(config)
        self.extensions = [factory(self.dispatcher) for factory in extension_factories]
        self.max_body_bytes = config.limits.max_body_bytes
        self.api = build_api(self.dispatcher, self.extensions)
        self.discovery: list = []  # EndpointSliceWatchers (ember.gateway.discovery), one per discovered deployment

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            endpoint = PROXY_ROUTES.get(scope["raw_path"] if scope.get("raw_path") else scope["path"].encode())
            if endpoint is not None and scope["method"] == "POST":
                await self._proxy(scope, receive, send, endpoint)
                return
            if scope["method"] == "POST" and scope["path"].startswith(JSON_POST_PREFIXES):
                content_type = next((value for name, value in scope["headers"] if name == b"content-type"), None)
                try:
                    check_json_content_type(content_type)
                except GatewayError as exc:
                    await send_error(send, exc)
                    return
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        await self.api(scope, receive, send)

    async def start(self) -> None:
        await self.dispatcher.start()
        if any(d.discovery is not None for model in self.config.models.values() for d in model.deployments):
            from ember.gateway.discovery import start_discovery  # the kubernetes client, only when used

            self.discovery = await start_discovery(self.dispatcher)
        for extension in self.extensions:
            await extension.start()

    async def stop(self) -> None:
        for extension in reversed(self.extensions):
            await extension.stop()
        for watcher in self.discovery:
            await watcher.stop()
        await self.dispatcher.stop()

    async def _lifespan(self, receive: Callable, send: Callable) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.start()
                except Exception as exc:  # noqa: BLE001 - reported to the server, which exits
                    await send({"type": "lifespan.startup.failed", "message": f"{type(exc).__name__}: {exc}"})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # --- the hot path ---------------------------------------------------------------------------

    async def _proxy(self, scope: dict, receive: Callable, send: Callable, endpoint: str) -> None:
        authorization = content_type = priority = deadline = region = session = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == b"content-type":
                content_type = value
            elif name.startswith(b"x-ember-"):
                if name == b"x-ember-priority":
                    priority = value
                elif name == b"x-ember-deadline-ms":
                    deadline = value
                elif name == b"x-ember-region":
                    region = value.decode("latin-1")
                elif name == b"x-ember-session-id":
                    session = value.decode("latin-1")
        watcher: DisconnectWatcher | None = None
        held_stream: HeldStream | None = None  # only for a stream that may wait for a cold start
        try:
            check_json_content_type(content_type)
            principal = self.dispatcher.authenticate(authorization)
            raw_body = await self._read_body(receive)
            body = parse_json_object(raw_body)
            watcher = DisconnectWatcher(receive, asyncio.current_task())
            if body.get("stream") is True:
                watcher.start()
            dispatching = self.dispatcher.dispatch(
                principal,
                endpoint,
                body,
                priority=parse_int_header(priority, "x-ember-priority"),
                deadline_s=parse_deadline(deadline),
                client_region=region,
                session_id=session,
                raw_body=raw_body,
            )
            if body.get("stream") is True and self.dispatcher.holds_for_a_replica(body.get("model")):
                held_stream = HeldStream(send)
                result = await held_stream.dispatch(dispatching)
            else:
                result = await dispatching
        except ClientDisconnected:
            return
        except Exception as exc:
            error = exc if isinstance(exc, GatewayError) else unexpected_error(scope["method"], scope["path"], exc)
            if watcher is not None:
                watcher.stop()
            if held_stream is not None and held_stream.opened:  # no status line left: the error is the last event
                await send({"type": "http.response.body", "body": sse.data_event(error.to_json())})
            else:
                await send_error(send, error)
            return
        except asyncio.CancelledError:
            if watcher is not None and watcher.fired:
                asyncio.current_task().uncancel()  # the client left; nothing to answer
                return
            raise
        headers = [(name.encode(), value.encode()) for name, value in result.headers.items()]
        headers.append((b"x-ember-replica", result.replica.id.encode()))
        try:
            opened = held_stream is not None and held_stream.opened
            if opened and not result.stream:  # the replica answered an error, not a stream
                watcher.stop()
                await send({"type": "http.response.body", "body": sse.data_event(result.body.strip())})
                return
            if not result.stream:
                watcher.stop()
                headers.append((b"content-length", str(len(result.body)).encode()))
                await send({"type": "http.response.start", "status": result.status, "headers": headers})
                await send({"type": "http.response.body", "body": result.body})
                return
            watcher.start()
            if not opened:
                headers = [header for header in headers if header[0] != b"content-type"] + SSE_HEADERS
                await send({"type": "http.response.start", "status": 200, "headers": headers})
            async for payload in result.events():
                await send({"type": "http.response.body", "body": sse.data_event(payload), "more_body": True})
            watcher.stop()
            await send({"type": "http.response.body", "body": sse.DONE_EVENT})
        except asyncio.CancelledError:
            if watcher.fired:
                asyncio.current_task().uncancel()
                return
            raise
        finally:
            watcher.stop()
            await result.aclose()

    async def _read_body(self, receive: Callable) -> bytes:
        message = await receive()
        body = message.get("body", b"")
        if not message.get("more_body"):
            return body
        chunks = [body]
        size = len(body)
        while message.get("more_body"):
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnected
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                raise GatewayError(
                    413, f"The request body is larger than {self.max_body_bytes} bytes.", code="request_too_large"
                )
        return b"".join(chunks)


class HeldStream:
    """A stream held while its model scales from zero: if no replica has taken it after
    HELD_KEEPALIVE_S, the SSE response opens (200, without the replica and rate-limit headers, which
    are not known yet) and a comment is sent every HELD_KEEPALIVE_S so that the client and any proxy
    in between keep the connection open; SSE clients ignore comments."""

    __slots__ = ("send", "opened")

    def __init__(self, send: Callable):
        self.send = send
        self.opened = False

    async def dispatch(self, dispatching: Awaitable[UpstreamResult]) -> UpstreamResult:
        task = asyncio.ensure_future(dispatching)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=HELD_KEEPALIVE_S)
                if done:
                    return task.result()
                if not self.opened:
                    self.opened = True
                    await self.send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
                await self.send({"type": "http.response.body", "body": KEEPALIVE_EVENT, "more_body": True})
        finally:
            task.cancel()  # a no-op once it is done; else the client left or the server stops


class DisconnectWatcher:
    """Cancels the request's task when its client disconnects (uvicorn answers receive() with
    http.disconnect), so a waiter leaves the queue and the replica's request is aborted.

    Streams are watched from the start. A non-streamed request is watched only once it has been in
    flight for WATCH_AFTER_S: most finish sooner, and a task per request costs throughput on the
    proxy path; a client that leaves earlier is noticed at most WATCH_AFTER_S late."""

    __slots__ = ("receive", "task", "fired", "_watch_task", "_timer")

    def __init__(self, receive: Callable, task: asyncio.Task):
        self.receive = receive
        self.task = task
        self.fired = False
        self._watch_task: asyncio.Task | None = None
        self._timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, self.start)

    def start(self) -> None:
        if self._watch_task is None:
            self._timer.cancel()
            self._watch_task = asyncio.create_task(self._watch())

    def stop(self) -> None:
        self._timer.cancel()
        if self._watch_task is not None:
            self._watch_task.cancel()

    async def _watch(self) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.fired = True
                self.task.cancel()
                return


async def send_error(send: Callable, exc: GatewayError) -> None:
    headers = [(b"content-type", b"application/json")]
    headers.extend((name.encode(), value.encode()) for name, value in exc.headers.items())
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": exc.to_json()})


def unexpected_error(method: str, path: str, exc: Exception) -> GatewayError:
    """An exception no handler expects (a bug): logged with its traceback, answered as OpenAI's 500."""
    logger.error("unhandled error on %s %s", method, path, exc_info=exc)
    return internal_error()


def check_json_content_type(content_type: bytes | None) -> None:
    """ember.http_rules' Content-Type rule for a JSON route, as a GatewayError."""
    value = None if content_type is None else content_type.decode("latin-1")
    if not is_json_content_type(value):
        raise GatewayError(UNSUPPORTED_MEDIA_TYPE, unsupported_media_type_message(value), code=UNSUPPORTED_MEDIA_TYPE_CODE)


def parse_int_header(value: bytes | None, name: str) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise bad_request(f"Header {name} must be an integer, got {value.decode('latin-1')!r}.") from None


def parse_deadline(value: bytes | None) -> float | None:
    if value is None:
        return None
    try:
        milliseconds = float(value)
    except ValueError:
        milliseconds = -1.0
    if not milliseconds > 0:
        raise bad_request(
            f"Header x-ember-deadline-ms must be a positive number of milliseconds, got {value.decode('latin-1')!r}."
        )
    return milliseconds / 1000


# --- everything but the hot path -----------------------------------------------------------------


def build_api(dispatcher: Dispatcher, extensions: Sequence[GatewayExtension]) -> FastAPI:
    api = FastAPI(title="Ember gateway", docs_url=None, redoc_url=None, openapi_url=None)

    @api.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        return error_response(exc)

    @api.exception_handler(asyncpg.PostgresError)
    @api.exception_handler(asyncpg.InterfaceError)
    async def _state_error(request: Request, exc: Exception) -> JSONResponse:
        # The admin key API with state.backend shared while PostgreSQL is down: a 503, not a 500.
        return error_response(state_unavailable("PostgreSQL", exc))

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "unknown_url", 405: "method_not_allowed"}.get(exc.status_code)
        message = (
            f"Unknown request URL: {request.method} {request.url.path}."
            if exc.status_code == 404
            else f"Method {request.method} is not allowed on {request.url.path}."
            if exc.status_code == 405
            else str(exc.detail)
        )
        return error_response(GatewayError(exc.status_code, message, code=code))

    @api.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        response = error_response(unexpected_error(request.method, request.url.path, exc))
        # Starlette raises the exception again once this is sent, and uvicorn then closes the connection:
        # said here, a keep-alive client does not send its next request on it.
        response.headers["connection"] = "close"
        return response

    @api.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(part) for part in first["loc"] if part != "body") or None
        return error_response(bad_request(f"{param}: {first['msg']}" if param else first["msg"], param=param))

    @api.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/ready")
    async def ready() -> JSONResponse:
        models = {model: len(dispatcher.pool.healthy(model)) for model in dispatcher.config.models}
        # An autoscaled model without replicas is ready: it holds requests while one starts.
        is_ready = all(count or dispatcher.config.models[model].autoscaling for model, count in models.items())
        return JSONResponse(
            {"status": "ready" if is_ready else "not_ready", "healthy_replicas": models},
            status_code=200 if is_ready else 503,
        )

    @api.get("/metrics")
    async def metrics(request: Request) -> Response:
        if dispatcher.config.metrics.require_auth:
            require_admin(dispatcher, request.headers.get("authorization"))
        return Response(dispatcher.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @api.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        principal = dispatcher.authenticate(request.headers.get("authorization"))
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "ember-gateway"}
            for name in dispatcher.config.models
            if principal.policy.allows_model(name)
        ]
        return {"object": "list", "data": data}

    @api.get("/v1/usage")
    async def usage(request: Request) -> dict[str, Any]:
        principal = dispatcher.authenticate(request.headers.get("authorization"))
        totals = dispatcher.usage.snapshot(principal.key_id)
        budget = principal.policy.token_budget
        return {
            "object": "usage",
            "key": principal.name,
            **totals,
            "token_budget": budget,
            "budget_remaining": None if budget is None else max(budget - totals["total_tokens"], 0),
            # Estimates of this key's requests in flight, held against the budget until their usage is known.
            "tokens_reserved": await dispatcher.limiter.reserved_tokens(principal.key_id),
            "limits": principal.policy.model_dump(exclude={"models"}),
        }

    api.include_router(build_admin_router(dispatcher))
    api.include_router(build_console_router(dispatcher))
    for extension in extensions:
        api.include_router(extension.router)
    return api


def create_app(config: GatewayConfig, extensions: Sequence[ExtensionFactory] = ()) -> GatewayApp:
    """The gateway as an ASGI app; `app.dispatcher` is its internal API (for tests and extensions)."""
    return GatewayApp(config, extensions)

