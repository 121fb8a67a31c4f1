"""Token usage per API key: live counters in memory (read by budgets and `GET /v1/usage`), flushed to
the key store's SQLite file in the background so budgets survive a restart."""

from __future__ import annotations

import asyncio
import contextlib

from ember.gateway.keys import KeyStore


class UsageLedger:
    def __init__(self, store: KeyStore | None, flush_interval_s: float = 1.0):
        self.store = store
        self.flush_interval_s = flush_interval_s
        # key_id -> [requests, prompt_tokens, completion_tokens]
        self._totals: dict[str, list[int]] = {}
        self._pending: dict[str, list[int]] = {}
        if store is not None:
            for key_id, counts in store.load_usage().items():
                self._totals[key_id] = list(counts)
        self._task: asyncio.Task | None = None

    def record(self, key_id: str, prompt_tokens: int, completion_tokens: int) -> None:
        for table in (self._totals, self._pending):
            counts = table.get(key_id)
            if counts is None:
                counts = table[key_id] = [0, 0, 0]
            counts[0] += 1
            counts[1] += prompt_tokens
            counts[2] += completion_tokens

    def total_tokens(self, key_id: str) -> int:
        counts = self._totals.get(key_id)
        return 0 if counts is None else counts[1] + counts[2]

    def snapshot(self, key_id: str) -> dict[str, int]:
        requests, prompt, completion = self._totals.get(key_id, (0, 0, 0))
        return {
            "requests": requests,
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def flush(self) -> None:
        if self.store is None or not self._pending:
            self._pending.clear()
            return
        pending, self._pending = self._pending, {}
        self.store.add_usage({key_id: (c[0], c[1], c[2]) for key_id, c in pending.items()})

    async def start(self) -> None:
        if self.store is not None:
            self._task = asyncio.create_task(self._flush_loop(), name="ember-gateway-usage-flush")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.flush()

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval_s)
            self.flush()
