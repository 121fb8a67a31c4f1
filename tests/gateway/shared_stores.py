"""PostgreSQL and Redis for the shared-state tests: a fresh schema and Redis key prefix per test, dropped
afterwards, so tests never see each other's keys, buckets or jobs. Tests skip, saying why, when the
servers are unreachable (`make test` expects them on 127.0.0.1:5432 and :6379, see docs/ha.md)."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import Iterator

import asyncpg
import pytest
import redis

POSTGRES_DSN = os.environ.get("EMBER_TEST_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("EMBER_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False


def require_stores() -> None:
    missing = [
        name for name, port in (("PostgreSQL", 5432), ("Redis", 6379)) if not _reachable("127.0.0.1", port)
    ]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not reachable on 127.0.0.1 (shared-state tests need both)")


def run_sql(sql: str, *args) -> list:
    async def run() -> list:
        connection = await asyncpg.connect(POSTGRES_DSN)
        try:
            return await connection.fetch(sql, *args)
        finally:
            await connection.close()

    return asyncio.run(run())


@pytest.fixture
def shared_state() -> Iterator[dict]:
    """The `state:` section of a gateway file, on a schema and key prefix of this test's own. Name it
    before `start_gateway` in a test's arguments, so the gateways stop before the schema is dropped."""
    require_stores()
    name = f"ember_test_{uuid.uuid4().hex[:12]}"
    yield {
        "backend": "shared",
        "postgres": {"dsn": POSTGRES_DSN, "schema": name},
        "redis": {"url": REDIS_URL, "key_prefix": name},
    }
    drop_shared_state(name)


def drop_shared_state(name: str) -> None:
    """Drop the schema `name` and every Redis key under the prefix `name` (one gateway file's shared state)."""
    run_sql(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{name}:*"))
    if keys:
        client.delete(*keys)
    client.close()
