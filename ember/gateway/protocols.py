"""The gateway's protocols beyond the synchronous HTTP proxy, as extensions of create_app: async jobs
with webhooks and the Batch API (sharing one job store and worker pool), the WebSocket endpoint, and
the gRPC listener when a port is configured (`async.grpc.port` or `ember gateway --grpc-port`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter

from ember.gateway.config import GatewayConfig
from ember.gateway.jobs import api as jobs_api
from ember.gateway.jobs import batches, files
from ember.gateway.jobs.config import AsyncConfig
from ember.gateway.jobs.runtime import JobsRuntime
from ember.gateway.ws import WebSocketExtension


class JobsExtension:
    """/v1/async/*, /v1/files*, /v1/batches*: routes over one job store, started with the gateway."""

    def __init__(self, dispatcher: Any, config: AsyncConfig, base_dir: Path | None) -> None:
        self.runtime = JobsRuntime(dispatcher, config, base_dir)
        self.router = APIRouter()
        self.router.include_router(jobs_api.build_router(self.runtime))
        self.router.include_router(files.build_router(self.runtime))
        self.router.include_router(batches.build_router(self.runtime))

    async def start(self) -> None:
        await self.runtime.start()

    async def stop(self) -> None:
        await self.runtime.stop()


def protocol_extensions(config: GatewayConfig, grpc_port: int | None = None) -> list:
    """Extension factories for create_app(config, extensions=...)."""
    settings = config.async_
    factories: list = [
        lambda dispatcher: JobsExtension(dispatcher, settings, config.base_dir),
        WebSocketExtension,
    ]
    port = grpc_port if grpc_port is not None else settings.grpc.port
    if port is not None:
        from ember.gateway.grpc_service import GrpcExtension  # grpc loads only when it is served

        factories.append(lambda dispatcher: GrpcExtension(dispatcher, settings.grpc.host, port))
    return factories
