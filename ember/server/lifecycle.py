"""Readiness and graceful shutdown.

On the first SIGTERM or SIGINT the server drains: /ready turns 503, new generation requests get 503,
requests in flight run to completion for up to `drain_timeout` seconds (then they are aborted in the
engine, which ends their streams with finish_reason "abort"), and the process exits 0. A second
signal exits at once."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from ember.server.errors import APIError

logger = logging.getLogger("ember.server")


class Lifecycle:
    def __init__(self, drain_timeout: float) -> None:
        self.drain_timeout = drain_timeout
        self.ready = False
        self.draining = False
        self.in_flight = 0
        self._idle: asyncio.Event | None = None

    def request_started(self) -> None:
        self.in_flight += 1

    def request_finished(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    async def drain(self, abort_all: Callable[[], Awaitable[None]]) -> None:
        """Stop admitting, then wait for in-flight requests (aborting them after the drain timeout)."""
        self.draining = True
        self.ready = False
        self._idle = asyncio.Event()
        if self.in_flight == 0:
            return
        logger.info(
            "draining: waiting up to %.1f s for %d request(s) in flight", self.drain_timeout, self.in_flight
        )
        try:
            await asyncio.wait_for(self._idle.wait(), self.drain_timeout)
        except TimeoutError:
            logger.warning("drain timeout: aborting %d request(s) still in flight", self.in_flight)
            await abort_all()
            # Aborted requests end within one engine step; don't let a stuck client hold the exit.
            try:
                await asyncio.wait_for(self._idle.wait(), 5.0)
            except TimeoutError:
                logger.warning("%d request(s) did not end after abort; exiting anyway", self.in_flight)


class DrainGate:
    """ASGI middleware: counts generation requests in flight and refuses new ones while draining."""

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle, paths: frozenset[str]) -> None:
        self.app = app
        self.lifecycle = lifecycle
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        if self.lifecycle.draining:
            error = APIError(
                503,
                "The server is shutting down and accepts no new requests",
                code="server_draining",
                headers={"Retry-After": "1"},
            )
            await error.response()(scope, receive, send)
            return
        self.lifecycle.request_started()
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.request_finished()


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with SIGTERM/SIGINT starting a drain instead of closing the listener at once."""

    def __init__(
        self,
        config: uvicorn.Config,
        lifecycle: Lifecycle,
        abort_all: Callable[[], Awaitable[None]],
        engine_failure: Callable[[], str | None] = lambda: None,
    ) -> None:
        super().__init__(config)
        self._lifecycle = lifecycle
        self._abort_all = abort_all
        self._engine_failure = engine_failure
        self.engine_failed = False  # the server exits because its engine died: the process exits non-zero
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signalled = False
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:  # noqa: ANN001 - uvicorn's signature
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def on_tick(self, counter: int) -> bool:
        # uvicorn calls this every 0.1 s; an engine that died (a crashed engine thread, a dead tensor-parallel
        # worker) can serve nothing: turn unready and exit, so a supervisor restarts the server.
        if not self.engine_failed and self.started and (failure := self._engine_failure()) is not None:
            logger.error("the engine failed (%s): exiting", failure)
            self.engine_failed = True
            self._lifecycle.ready = False
            self.should_exit = True
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn's handler re-raises captured signals after shutdown, which would make the exit
        # status -SIGTERM; record nothing so a drained shutdown exits 0.
        if self._signalled or self._loop is None:
            logger.warning("second %s: exiting without waiting", signal.Signals(sig).name)
            self.should_exit = True
            self.force_exit = True
            return
        self._signalled = True
        logger.info("%s received: draining", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._lifecycle.drain(self._abort_all)
        finally:
            self.should_exit = True
