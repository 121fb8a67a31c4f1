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
    (
        2,
        # The async job store (ember.gateway.shared.jobs): SQLite's tables (ember.gateway.jobs.store) plus
        # leases, so a job or a webhook delivery whose gateway died is taken over by another gateway.
        """
        CREATE TABLE jobs (
            seq BIGSERIAL UNIQUE,
            id TEXT PRIMARY KEY,
            key_id TEXT NOT NULL,
            owner TEXT NOT NULL,
            kind TEXT NOT NULL,
            endpoint TEXT NOT NULL,
            body TEXT NOT NULL,
            priority INTEGER NOT NULL,
            webhook_url TEXT,
            max_time_in_queue_s DOUBLE PRECISION NOT NULL,
            queue_deadline DOUBLE PRECISION NOT NULL,
            status TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            started_at DOUBLE PRECISION,
            finished_at DOUBLE PRECISION,
            run_after DOUBLE PRECISION NOT NULL DEFAULT 0,
            attempts INTEGER NOT NULL DEFAULT 0,
            status_code INTEGER,
            result TEXT,
            error TEXT,
            batch_id TEXT,
            custom_id TEXT,
            webhook_status TEXT,
            lease_owner TEXT,
            lease_expires DOUBLE PRECISION,
            webhook_owner TEXT,
            webhook_lease_expires DOUBLE PRECISION
        );
        CREATE INDEX jobs_queue_urgent_first ON jobs (status, priority DESC, created_at, seq);
        CREATE INDEX jobs_batch_status ON jobs (batch_id, status);
        CREATE INDEX jobs_lease ON jobs (status, lease_expires);
        CREATE INDEX jobs_webhook ON jobs (webhook_status, webhook_lease_expires);
        CREATE TABLE webhook_attempts (
            job_id TEXT NOT NULL,
            attempt INTEGER NOT NULL,
            at DOUBLE PRECISION NOT NULL,
            status_code INTEGER,
            error TEXT,
            PRIMARY KEY (job_id, attempt)
        );
        CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
        """,
    ),
    (
        3,
        # The Files and Batch API (ember.gateway.shared.batches): SQLite's tables, `seq` for its rowid order.
        """
        CREATE TABLE files (
            seq BIGSERIAL UNIQUE,
            id TEXT PRIMARY KEY,
            key_id TEXT NOT NULL,
            filename TEXT NOT NULL,
            purpose TEXT NOT NULL,
            bytes BIGINT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            content BYTEA NOT NULL
        );
        CREATE INDEX files_key ON files (key_id, created_at);
        CREATE TABLE batches (
            seq BIGSERIAL UNIQUE,
            id TEXT PRIMARY KEY,
            key_id TEXT NOT NULL,
            endpoint TEXT NOT NULL,
            input_file_id TEXT NOT NULL,
            completion_window TEXT NOT NULL,
            status TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            in_progress_at DOUBLE PRECISION,
            expires_at DOUBLE PRECISION NOT NULL,
            finalizing_at DOUBLE PRECISION,
            completed_at DOUBLE PRECISION,
            failed_at DOUBLE PRECISION,
            expired_at DOUBLE PRECISION,
            cancelling_at DOUBLE PRECISION,
            cancelled_at DOUBLE PRECISION,
            output_file_id TEXT,
            error_file_id TEXT,
            metadata TEXT,
            total INTEGER NOT NULL
        );
        CREATE INDEX batches_key ON batches (key_id, created_at);
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
