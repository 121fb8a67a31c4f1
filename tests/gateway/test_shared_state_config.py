"""The `state:` section: validated like the rest of the gateway file; the shared backend's schema
migrations apply each version once however many gateways start at the same moment."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
from shared_stores import POSTGRES_DSN, run_sql

from ember.gateway.config import GatewayConfigError, parse_config
from ember.gateway.shared.config import StateConfig
from ember.gateway.shared.connection import MIGRATIONS, SharedState, migrate
from ember.gateway.shared.jobs import SharedJobStore

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


def test_retention_deletes_old_jobs_and_batches_with_their_files(shared_state):
    """The shared store's sweep keeps what SQLite's keeps: recent results, and pending webhooks."""
    schema = shared_state["postgres"]["schema"]
    asyncio.run(_migrate_again(schema))
    run_sql(
        f'INSERT INTO "{schema}".jobs (id, key_id, owner, kind, endpoint, body, priority, max_time_in_queue_s,'
        " queue_deadline, status, created_at, finished_at, batch_id, webhook_status, webhook_url) VALUES"
        " ('old', 'k', '{}', 'async', 'e', '{}', 0, 1, 1, 'succeeded', 1, 10, NULL, NULL, NULL),"
        " ('old-pending-hook', 'k', '{}', 'async', 'e', '{}', 0, 1, 1, 'succeeded', 1, 10, NULL, 'pending', 'http://h'),"
        " ('recent', 'k', '{}', 'async', 'e', '{}', 0, 1, 1, 'succeeded', 1, 990, NULL, NULL, NULL),"
        " ('old-batch-request', 'k', '{}', 'batch', 'e', '{}', 0, 1, 1, 'succeeded', 1, 10, 'b1', NULL, NULL)"
    )
    run_sql(
        f'INSERT INTO "{schema}".batches (id, key_id, endpoint, input_file_id, completion_window, status,'
        " created_at, expires_at, completed_at, output_file_id, total) VALUES"
        " ('b1', 'k', 'e', 'in', '24h', 'completed', 1, 100, 10, 'out', 1)"
    )
    run_sql(
        f'INSERT INTO "{schema}".files (id, key_id, filename, purpose, bytes, created_at, content) VALUES'
        " ('in', 'k', 'in.jsonl', 'batch', 1, 1, 'x'), ('out', 'k', 'out.jsonl', 'batch_output', 1, 10, 'y')"
    )

    async def sweep() -> int:
        state = SharedState(StateConfig.model_validate(shared_state))
        await state.open()
        try:
            return await SharedJobStore(state, max_attempts=3).delete_expired_results(ttl_s=100, now=1000)
        finally:
            await state.close()

    assert asyncio.run(sweep()) == 2  # the old async job and the old batch
    assert sorted(row[0] for row in run_sql(f'SELECT id FROM "{schema}".jobs')) == [
        "old-pending-hook",
        "recent",
    ]
    assert [row[0] for row in run_sql(f'SELECT id FROM "{schema}".batches')] == []
    assert [row[0] for row in run_sql(f'SELECT id FROM "{schema}".files')] == [
        "in"
    ]  # the input is the user's


def test_connection_strings_can_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("EMBER_TEST_DSN", "postgresql://ember:secret@db:5432/ember")
    monkeypatch.setenv("EMBER_TEST_REDIS", "redis://:secret@cache:6379/0")
    state = {
        "backend": "shared",
        "postgres": {"dsn_env": "EMBER_TEST_DSN"},
        "redis": {"url_env": "EMBER_TEST_REDIS"},
    }
    config = parse_config({"models": MODELS, "state": state})
    assert config.state.postgres.dsn == "postgresql://ember:secret@db:5432/ember"
    assert config.state.redis.url == "redis://:secret@cache:6379/0"
    monkeypatch.delenv("EMBER_TEST_DSN")
    with pytest.raises(
        GatewayConfigError, match="state.postgres: dsn_env: environment variable 'EMBER_TEST_DSN' is not set"
    ):
        parse_config({"models": MODELS, "state": state})
    both = {**state, "postgres": {"dsn": "postgresql://h/db", "dsn_env": "X"}}
    with pytest.raises(GatewayConfigError, match="set dsn or dsn_env, not both"):
        parse_config({"models": MODELS, "state": both})
