"""The shared stores of `state: {backend: shared}`: one asyncpg pool and one redis-py asyncio client per
gateway process, opened when the gateway starts.

Opening runs the schema migrations: every version in MIGRATIONS not yet recorded in
`<schema>.schema_migrations` is applied in order, in one transaction that first takes a
transaction-scoped advisory lock, so gateways starting together apply each version exactly once and
the later ones find everything done.
"""

from __future__ import annotations

import asyncpg
import redis.asyncio as aioredis

from ember.errors import EmberError
from ember.gateway.errors import GatewayError
from ember.gateway.shared.config import StateConfig

# (version, SQL) in order; a released version is never edited, a change is a new version.
MIGRATIONS: list[tuple[int, str]] = [
    (
        1,
        """
        CREATE TABLE api_keys (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL,
            sha256 TEXT NOT NULL UNIQUE,
            display TEXT NOT NULL,
            policy JSONB NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            revoked_at DOUBLE PRECISION
        );
        CREATE UNIQUE INDEX api_keys_live_name ON api_keys(name) WHERE revoked_at IS NULL;
        CREATE TABLE key_usage (
            key_id TEXT PRIMARY KEY,
            requests BIGINT NOT NULL DEFAULT 0,
            prompt_tokens BIGINT NOT NULL DEFAULT 0,
            completion_tokens BIGINT NOT NULL DEFAULT 0
        );
        """,
    ),
]


# What a lost PostgreSQL connection raises, besides OSError while (re)connecting.
POSTGRES_ERRORS = (asyncpg.PostgresError, asyncpg.InterfaceError)


def state_unavailable(store: str, exc: Exception) -> GatewayError:
    """The 503 of a request that needed PostgreSQL or Redis while it was unreachable."""
    return GatewayError(
        503,
        f"The gateway's shared state ({store}) is unreachable: {exc}",
        "service_unavailable",
        "state_unavailable",
    )


class SharedStateError(EmberError):
    """PostgreSQL or Redis could not be reached or migrated when the gateway started."""


class SharedState:
    def __init__(self, config: StateConfig):
        assert config.postgres is not None and config.redis is not None
        self.config = config
        self.schema = config.postgres.schema_
        self.key_prefix = config.redis.key_prefix
        self.lease_s = config.redis.lease_s
        self._pool: asyncpg.Pool | None = None
        self.redis = aioredis.Redis.from_url(config.redis.url, decode_responses=True)

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise SharedStateError("the shared state is not open yet (the gateway has not started)")
        return self._pool

    async def open(self) -> None:
        postgres = self.config.postgres
        try:
            self._pool = await asyncpg.create_pool(
                postgres.dsn,
                min_size=postgres.min_connections,
                max_size=postgres.max_connections,
                server_settings={"search_path": self.schema},
            )
            async with self._pool.acquire() as connection:
                await migrate(connection, self.schema)
        except (OSError, asyncpg.PostgresError) as exc:
            await self.close()
            raise SharedStateError(f"cannot open PostgreSQL for the shared state: {exc}") from None
        try:
            await self.redis.ping()
        except aioredis.RedisError as exc:
            await self.close()
            raise SharedStateError(f"cannot reach Redis at {self.config.redis.url}: {exc}") from None

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None
        await self.redis.aclose()


async def migrate(connection: asyncpg.Connection, schema: str) -> list[int]:
    """Apply the migrations `schema` lacks; returns the versions this call applied."""
    async with connection.transaction():
        # Serialises concurrent gateways on this schema until this transaction ends.
        await connection.execute("SELECT pg_advisory_xact_lock(hashtext($1))", f"ember-migrations:{schema}")
        await connection.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
        await connection.execute(
            f'CREATE TABLE IF NOT EXISTS "{schema}".schema_migrations '
            "(version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"
        )
        done = {
            row["version"]
            for row in await connection.fetch(f'SELECT version FROM "{schema}".schema_migrations')
        }
        applied = []
        await connection.execute(f'SET LOCAL search_path TO "{schema}"')
        for version, sql in MIGRATIONS:
            if version in done:
                continue
            await connection.execute(sql)
            await connection.execute("INSERT INTO schema_migrations (version) VALUES ($1)", version)
            applied.append(version)
        return applied
