"""Token usage shared by every gateway: each gateway adds its own requests to PostgreSQL as deltas once a
second and then reads every gateway's totals back, so budgets and `GET /v1/usage` count all gateways'
requests, each once. Another gateway's completed requests reach this one's totals within about two
flush intervals; until then only their reservations (Redis) are missing from the budget check."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import asyncpg

from ember.gateway.shared.keys import SharedKeyStore
from ember.gateway.usage import UsageLedger

logger = logging.getLogger(__name__)


class SharedUsageLedger(UsageLedger):
    def __init__(self, store: SharedKeyStore, flush_interval_s: float = 1.0):
        super().__init__(None, flush_interval_s)
        self.shared_store = store

    async def start(self) -> None:
        self._replace_totals(await self.shared_store.load_usage())
        self._task = asyncio.create_task(self._flush_loop(), name="ember-gateway-usage-flush")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.flush_shared()

    async def flush_shared(self) -> None:
        """Add this gateway's new usage to PostgreSQL, then take every gateway's totals."""
        pending, self._pending = self._pending, {}
        if pending:
            try:
                await self.shared_store.add_usage(
                    {key_id: (c[0], c[1], c[2]) for key_id, c in pending.items()}
                )
            except (OSError, asyncpg.PostgresError) as exc:
                # Not written (the deltas go in one transaction): kept for the next flush, never counted twice.
                for key_id, counts in pending.items():
                    self._add(self._pending, key_id, counts)
                logger.warning("could not flush usage to PostgreSQL: %s", exc)
                return
        try:
            totals = await self.shared_store.load_usage()
        except (OSError, asyncpg.PostgresError) as exc:
            logger.warning("could not read usage from PostgreSQL: %s", exc)
            return
        self._replace_totals(totals)

    def _replace_totals(self, stored: dict[str, tuple[int, int, int]]) -> None:
        """Stored totals plus what this gateway recorded since its last flush."""
        totals = {key_id: list(counts) for key_id, counts in stored.items()}
        for key_id, counts in self._pending.items():
            self._add(totals, key_id, counts)
        self._totals = totals

    @staticmethod
    def _add(table: dict[str, list[int]], key_id: str, counts: list[int]) -> None:
        row = table.setdefault(key_id, [0, 0, 0])
        for index, value in enumerate(counts):
            row[index] += value

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval_s)
            await self.flush_shared()
