"""A background asyncio task that runs one round of work (at once, or after a first delay) and then
every `interval_s`, for the gateway's health prober and metrics scraper (started/stopped by the
gateway's lifespan)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger("ember.gateway")


class PeriodicTask:
    def __init__(self, name: str, interval_s: float, round_: Callable[[], Awaitable[None]]):
        self.name = name
        self.interval_s = interval_s
        self._round = round_
        self._task: asyncio.Task | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self, first_round_after_s: float = 0.0) -> None:
        if not self.running:
            self._task = asyncio.create_task(self._loop(first_round_after_s), name=self.name)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _loop(self, first_round_after_s: float) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(first_round_after_s)
        while True:
            started = loop.time()
            try:
                await self._round()
            except Exception:  # one bad round must not end probing for the life of the gateway
                logger.exception("%s: round failed", self.name)
            await asyncio.sleep(max(self.interval_s - (loop.time() - started), 0.0))
