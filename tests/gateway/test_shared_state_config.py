"""The `state:` section: validated like the rest of the gateway file; the shared backend's schema
migrations apply each version once however many gateways start at the same moment."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
from shared_stores import POSTGRES_DSN, run_sql

from ember.gateway.config import GatewayConfigError, parse_config
from ember.gateway.shared.connection import MIGRATIONS, migrate

MODELS = {"tiny": {"deployments": [{"name": "main", "replicas": [{"url": "http://127.0.0.1:9"}]}]}}


def test_migrations_apply_once_when_gateways_start_together(shared_state):
    schema = shared_state["postgres"]["schema"]

    async def start_three() -> list[list[int]]:
        connections = [await asyncpg.connect(POSTGRES_DSN) for _ in range(3)]
        try:
            return await asyncio.gather(*(migrate(connection, schema) for connection in connections))
        finally:
            for connection in connections:
                await connection.close()

    applied = asyncio.run(start_three())
    every_version = [version for version, _ in MIGRATIONS]
    assert sorted(applied, key=len) == [[], [], every_version]
    rows = run_sql(f'SELECT version FROM "{schema}".schema_migrations ORDER BY version')
    assert [row["version"] for row in rows] == every_version
    assert asyncio.run(_migrate_again(schema)) == []


async def _migrate_again(schema: str) -> list[int]:
    connection = await asyncpg.connect(POSTGRES_DSN)
    try:
        return await migrate(connection, schema)
    finally:
        await connection.close()


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"backend": "shared", "redis": {"url": "redis://127.0.0.1:6379"}}, "backend 'shared' needs both"),
        (
            {"backend": "embedded", "redis": {"url": "redis://127.0.0.1:6379"}},
            "used only with backend: shared",
        ),
        (
            {"backend": "shared", "postgres": {"dsn": "mysql://x"}, "redis": {"url": "redis://h"}},
            "state.postgres.dsn",
        ),
        (
            {
                "backend": "shared",
                "postgres": {"dsn": "postgresql://h/db", "schema": "Bad-Name"},
                "redis": {"url": "redis://h"},
            },
            "state.postgres.schema",
        ),
        ({"backend": "replicated"}, "state.backend"),
    ],
)
def test_state_section_is_validated(state, message):
    with pytest.raises(GatewayConfigError, match=message):
        parse_config({"models": MODELS, "state": state})


def test_shared_state_refuses_the_sqlite_key_store():
    state = {"backend": "shared", "postgres": {"dsn": "postgresql://h/db"}, "redis": {"url": "redis://h"}}
    with pytest.raises(GatewayConfigError, match="keys.store is the embedded SQLite key store"):
        parse_config({"models": MODELS, "keys": {"store": "keys.db"}, "state": state})
