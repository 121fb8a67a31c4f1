"""Gateway extensions: the protocols beyond the synchronous HTTP proxy, mounted by create_app.

The interface, both sides typed: an extension gets the gateway's `GatewayServices` (what any protocol
may use: authenticate a caller, dispatch a request through keys, limits, queue, routing and failover,
and read the config, replica pool, key ring and metrics), and is a `GatewayExtension` (its routes
join the gateway's FastAPI app; it starts after and stops before the dispatcher). The Dispatcher is
the implementation of GatewayServices; `create_app(config, extensions=[factory])` calls each factory
with it.

The built-in extensions (`protocol_extensions`): async jobs with webhooks and the Batch API (sharing
one job store and worker pool), the WebSocket endpoint, and the gRPC listener when a port is
configured (`async.grpc.port` or `ember gateway --grpc-port`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from fastapi import APIRouter

from ember.gateway.config import GatewayConfig
from ember.gateway.jobs import admin as jobs_admin
from ember.gateway.jobs import api as jobs_api
from ember.gateway.jobs import batches, files
from ember.gateway.jobs.config import AsyncConfig
from ember.gateway.jobs.runtime import JobsRuntime
from ember.gateway.ws import WebSocketExtension

if TYPE_CHECKING:
    from ember.gateway.keys import KeyRing, Principal
    from ember.gateway.metrics import GatewayMetrics
    from ember.gateway.proxy import UpstreamResult
    from ember.gateway.replicas import ReplicaPool
    from ember.gateway.shared.connection import SharedState


@runtime_checkable  # so a test can check that the Dispatcher still provides every member
class GatewayServices(Protocol):
    """What an extension may use of the gateway (ember.gateway.dispatch.Dispatcher provides it)."""

    config: GatewayConfig
    pool: ReplicaPool
    keys: KeyRing
    metrics: GatewayMetrics
    shared: SharedState | None  # PostgreSQL + Redis with state.backend shared

    def authenticate(self, authorization_header: str | None) -> Principal:
        """The caller of an `Authorization: Bearer <key>` header; GatewayError 401 otherwise."""
        ...

    async def dispatch(
        self,
        principal: Principal,
        endpoint: str,
        body: dict,
        *,
        priority: int | None = None,
        deadline_s: float | None = None,
        client_region: str | None = None,
        session_id: str | None = None,
        is_background: bool = False,
    ) -> UpstreamResult:
        """Send one "chat/completions" or "completions" request to a replica, as the HTTP proxy does;
        GatewayError for every refusal. Always `await result.aclose()`."""
        ...


@runtime_checkable
class GatewayExtension(Protocol):
    """A feature mounted on the gateway: its routes join the FastAPI app and it starts/stops with the gateway."""

    router: APIRouter

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


ExtensionFactory = Callable[[GatewayServices], GatewayExtension]


class JobsExtension:
    """/v1/async/*, /v1/files*, /v1/batches* and the admin's /admin/jobs, /admin/batches: routes over one
    job store, started with the gateway."""

    def __init__(self, dispatcher: GatewayServices, config: AsyncConfig, base_dir: Path | None) -> None:
        self.runtime = JobsRuntime(dispatcher, config, base_dir)
        self.router = APIRouter()
        self.router.include_router(jobs_api.build_router(self.runtime))
        self.router.include_router(files.build_router(self.runtime))
        self.router.include_router(batches.build_router(self.runtime))
        self.router.include_router(jobs_admin.build_router(self.runtime))

    async def start(self) -> None:
        await self.runtime.start()

    async def stop(self) -> None:
        await self.runtime.stop()


def protocol_extensions(config: GatewayConfig, grpc_port: int | None = None) -> list[ExtensionFactory]:
    """Extension factories for create_app(config, extensions=...)."""
    settings = config.async_
    factories: list[ExtensionFactory] = [
        lambda dispatcher: JobsExtension(dispatcher, settings, config.base_dir),
        WebSocketExtension,
    ]
    port = grpc_port if grpc_port is not None else settings.grpc.port
    if port is not None:
        from ember.gateway.grpc_service import GrpcExtension  # grpc loads only when it is served

        factories.append(lambda dispatcher: GrpcExtension(dispatcher, settings.grpc.host, port))
    return factories
