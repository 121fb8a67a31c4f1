"""API keys and their usage in PostgreSQL (`state: {backend: shared}`), for every gateway at once.

The proxy path never waits on PostgreSQL: each gateway holds every live key in memory (digest ->
principal) and reloads them when another gateway creates or revokes one (LISTEN/NOTIFY on
`<schema>_keys`, milliseconds) and every `KEYS_RELOAD_S` in any case. A revocation is also marked in
Redis, where every gateway's admission checks it (ember.gateway.shared.ratelimit), so the other gateways
refuse the key from their very next request, before they reload.

Usage is written as additive deltas (`add_usage`), so each gateway's requests are counted once
however many gateways flush at the same time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

import asyncpg
import redis.asyncio as aioredis
from pydantic import ValidationError

from ember.gateway.config import KeyPolicy, validation_message
from ember.gateway.keys import DISPLAY_CHARS, KeyStoreError, Principal, StoredKey, generate_key, hash_key
from ember.gateway.shared.connection import SharedState
from ember.gateway.shared.ratelimit import REVOKED_MARKER_S, limits_key

logger = logging.getLogger(__name__)

KEYS_RELOAD_S = 1.0
_COLUMNS = "id, name, display, policy::text, created_at, revoked_at"


class SharedKeyStore:
    def __init__(self, state: SharedState):
        self.state = state
        self.channel = f"{state.schema}_keys"
        self._live: dict[str, Principal] = {}  # digest -> principal of every live key
        self._listener: asyncpg.Connection | None = None
        self._reload_task: asyncio.Task | None = None
        self._notified: set[asyncio.Task] = set()  # reloads started by NOTIFY, referenced until done

    # --- the proxy path -----------------------------------------------------------------------

    def find(self, digest: str) -> Principal | None:
        return self._live.get(digest)

    def live_key(self, key_id: str) -> Principal | None:
        """The live key with this id (a job's submitter, re-checked before its job runs)."""
        return next((principal for principal in self._live.values() if principal.key_id == key_id), None)

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.reload()
        postgres = self.state.config.postgres
        self._listener = await asyncpg.connect(
            postgres.dsn, server_settings={"search_path": self.state.schema}
        )
        await self._listener.add_listener(self.channel, self._on_notify)
        self._reload_task = asyncio.create_task(self._reload_loop(), name="ember-gateway-keys-reload")

    async def stop(self) -> None:
        if self._reload_task is not None:
            self._reload_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reload_task
        if self._listener is not None:
            await self._listener.close()

    async def reload(self) -> None:
        rows = await self.state.pool.fetch(
            f"SELECT {_COLUMNS}, sha256 FROM api_keys WHERE revoked_at IS NULL"
        )
        live = {}
        for row in rows:
            record = self._record(row)
            live[row["sha256"]] = Principal(record.id, record.name, record.policy)
        self._live = live

    def _on_notify(self, connection, pid, channel, payload) -> None:
        task = asyncio.get_running_loop().create_task(self._reload_logged())
        self._notified.add(task)
        task.add_done_callback(self._notified.discard)

    async def _reload_loop(self) -> None:
        while True:
            await asyncio.sleep(KEYS_RELOAD_S)
            await self._reload_logged()

    async def _reload_logged(self) -> None:
        try:
            await self.reload()
        except (OSError, asyncpg.PostgresError) as exc:  # keep serving the keys loaded last
            logger.warning("could not reload API keys from PostgreSQL: %s", exc)

    # --- the admin API (ember.gateway.admin) ----------------------------------------------------

    async def create(self, name: str, policy: KeyPolicy) -> tuple[str, StoredKey]:
        if not name.strip():
            raise KeyStoreError("a key needs a non-empty name")
        key = generate_key()
        record = StoredKey(
            uuid.uuid4().hex[:16], name, key[:DISPLAY_CHARS] + "...", policy, time.time(), None
        )
        try:
            async with self.state.pool.acquire() as connection, connection.transaction():
                await connection.execute(
                    "INSERT INTO api_keys (id, name, sha256, display, policy, created_at) VALUES ($1,$2,$3,$4,$5::jsonb,$6)",
                    record.id, name, hash_key(key), record.display, policy.model_dump_json(), record.created_at,
                )  # fmt: skip
                await connection.execute("SELECT pg_notify($1, 'created')", self.channel)
        except asyncpg.UniqueViolationError:
            raise KeyStoreError(f"a live key named {name!r} already exists") from None
        await self.reload()
        return key, record

    async def list(self, include_revoked: bool = False) -> list[StoredKey]:
        where = "" if include_revoked else " WHERE revoked_at IS NULL"
        rows = await self.state.pool.fetch(f"SELECT {_COLUMNS} FROM api_keys{where} ORDER BY created_at")
        return [self._record(row) for row in rows]

    async def get(self, id_or_name: str) -> StoredKey:
        row = await self.state.pool.fetchrow(
            f"SELECT {_COLUMNS} FROM api_keys WHERE id = $1 OR (name = $1 AND revoked_at IS NULL) "
            "ORDER BY revoked_at IS NULL DESC LIMIT 1",
            id_or_name,
        )
        if row is None:
            raise KeyStoreError(f"no key with id or name {id_or_name!r}")
        return self._record(row)

    async def revoke(self, id_or_name: str) -> StoredKey:
        record = await self.get(id_or_name)
        revoked_at = time.time()
        async with self.state.pool.acquire() as connection, connection.transaction():
            status = await connection.execute(
                "UPDATE api_keys SET revoked_at = $1 WHERE id = $2 AND revoked_at IS NULL",
                revoked_at,
                record.id,
            )
            if status == "UPDATE 0":
                raise KeyStoreError(f"key {record.name!r} ({record.id}) is already revoked")
            await connection.execute("SELECT pg_notify($1, 'revoked')", self.channel)
        marker = limits_key(self.state.key_prefix, record.id, "revoked")
        try:  # every gateway's next admission refuses it, before any has reloaded its keys
            await self.state.redis.set(marker, "1", ex=REVOKED_MARKER_S)
        except aioredis.RedisError as exc:  # revoked all the same: the gateways see it at their reload
            logger.warning("could not mark key %s revoked in Redis: %s", record.id, exc)
        await self.reload()
        return StoredKey(record.id, record.name, record.display, record.policy, record.created_at, revoked_at)

    # --- usage (ember.gateway.shared.usage) ------------------------------------------------------

    async def load_usage(self) -> dict[str, tuple[int, int, int]]:
        rows = await self.state.pool.fetch(
            "SELECT key_id, requests, prompt_tokens, completion_tokens FROM key_usage"
        )
        return {row[0]: (row[1], row[2], row[3]) for row in rows}

    async def add_usage(self, deltas: dict[str, tuple[int, int, int]]) -> None:
        await self.state.pool.executemany(
            "INSERT INTO key_usage (key_id, requests, prompt_tokens, completion_tokens) VALUES ($1,$2,$3,$4) "
            "ON CONFLICT (key_id) DO UPDATE SET requests = key_usage.requests + excluded.requests, "
            "prompt_tokens = key_usage.prompt_tokens + excluded.prompt_tokens, "
            "completion_tokens = key_usage.completion_tokens + excluded.completion_tokens",
            # In key order, so two gateways flushing the same keys lock their rows in the same order.
            [(key_id, *delta) for key_id, delta in sorted(deltas.items())],
        )

    def _record(self, row) -> StoredKey:
        try:
            policy = KeyPolicy.model_validate_json(row[3])
        except ValidationError as exc:
            raise KeyStoreError(validation_message(f"key {row[1]!r} in PostgreSQL", exc)) from None
        return StoredKey(row[0], row[1], row[2], policy, row[4], row[5])
