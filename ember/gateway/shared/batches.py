"""The Files and Batch API in PostgreSQL (`state: {backend: shared}`): the interface of
ember.gateway.jobs.store_batches.BatchStore, answering with the same objects (built by its helpers).

A batch and all its requests are stored in one transaction; its requests are ordinary jobs of the
shared job store, so any gateway runs them. Closing a batch locks its row first, so when two gateways
finish its last two requests at the same moment exactly one writes the output files and closes it.
"""

from __future__ import annotations

from typing import Any

import asyncpg
import orjson

from ember.gateway.jobs.store import Job, new_id
from ember.gateway.jobs.store_batches import NewBatch, ResultLine, StoredFile, batch_object, stored_file
from ember.gateway.shared.jobs import SharedJobStore, insert_jobs

_FILE_COLUMNS = "id, key_id, filename, purpose, bytes, created_at"


class SharedBatchStore:
    def __init__(self, store: SharedJobStore) -> None:
        self.store = store

    @property
    def pool(self) -> asyncpg.Pool:
        return self.store.pool

    # -- files --------------------------------------------------------------------------------

    async def add_file(
        self, key_id: str, filename: str, purpose: str, content: bytes, now: float
    ) -> StoredFile:
        async with self.pool.acquire() as connection:
            return await _insert_file(connection, key_id, filename, purpose, content, now)

    async def list_files(self, key_id: str) -> list[StoredFile]:
        rows = await self.pool.fetch(
            f"SELECT {_FILE_COLUMNS} FROM files WHERE key_id = $1 ORDER BY created_at DESC, seq DESC", key_id
        )
        return [stored_file(row) for row in rows]

    async def get_file(self, file_id: str, key_id: str) -> StoredFile | None:
        row = await self.pool.fetchrow(
            f"SELECT {_FILE_COLUMNS} FROM files WHERE id = $1 AND key_id = $2", file_id, key_id
        )
        return None if row is None else stored_file(row)

    async def file_content(self, file_id: str, key_id: str) -> bytes | None:
        return await self.pool.fetchval(
            "SELECT content FROM files WHERE id = $1 AND key_id = $2", file_id, key_id
        )

    async def file_with_content(self, file_id: str, key_id: str) -> tuple[StoredFile | None, bytes | None]:
        row = await self.pool.fetchrow(
            f"SELECT {_FILE_COLUMNS}, content FROM files WHERE id = $1 AND key_id = $2", file_id, key_id
        )
        return (None, None) if row is None else (stored_file(row), row["content"])

    async def delete_file(self, file_id: str, key_id: str) -> bool:
        status = await self.pool.execute("DELETE FROM files WHERE id = $1 AND key_id = $2", file_id, key_id)
        return status != "DELETE 0"

    # -- batches ------------------------------------------------------------------------------

    async def create_batch(self, batch: NewBatch, now: float) -> dict[str, Any]:
        async with self.pool.acquire() as connection, connection.transaction():
            await connection.execute(
                "INSERT INTO batches (id, key_id, endpoint, input_file_id, completion_window, status, created_at,"
                " in_progress_at, expires_at, metadata, total) VALUES ($1, $2, $3, $4, $5, 'in_progress', $6, $6, $7, $8, $9)",
                batch.id, batch.key_id, batch.endpoint, batch.input_file_id, batch.completion_window, now,
                now + batch.window_s, None if batch.metadata is None else orjson.dumps(batch.metadata).decode(),
                len(batch.jobs),
            )  # fmt: skip
            await insert_jobs(connection, batch.jobs, now)
            return await _select_batch(connection, batch.id, batch.key_id)

    async def get_batch(self, batch_id: str, key_id: str) -> dict[str, Any] | None:
        async with self.pool.acquire() as connection:
            return await _select_batch(connection, batch_id, key_id)

    async def list_batches(self, key_id: str | None, limit: int, after: str | None) -> list[dict[str, Any]]:
        """As BatchStore.list_batches: `key_id` None lists every key's batches (the admin's view)."""
        async with self.pool.acquire() as connection:
            anchor = None
            if after:
                anchor = await connection.fetchrow(
                    "SELECT created_at, seq FROM batches WHERE id = $1 AND ($2::text IS NULL OR key_id = $2)",
                    after, key_id,
                )  # fmt: skip
            if anchor is None:
                rows = await connection.fetch(
                    "SELECT * FROM batches WHERE ($1::text IS NULL OR key_id = $1)"
                    " ORDER BY created_at DESC, seq DESC LIMIT $2",
                    key_id, limit,
                )  # fmt: skip
            else:
                rows = await connection.fetch(
                    "SELECT * FROM batches WHERE ($1::text IS NULL OR key_id = $1) AND (created_at, seq) < ($2, $3)"
                    " ORDER BY created_at DESC, seq DESC LIMIT $4",
                    key_id, anchor["created_at"], anchor["seq"], limit,
                )  # fmt: skip
            return [batch_object(row, await _job_counts(connection, row["id"])) for row in rows]

    async def start_cancelling(
        self, batch_id: str, key_id: str, now: float
    ) -> tuple[dict[str, Any] | None, list[str], int]:
        async with self.pool.acquire() as connection, connection.transaction():
            await connection.execute("SELECT 1 FROM batches WHERE id = $1 FOR UPDATE", batch_id)
            batch = await _select_batch(connection, batch_id, key_id)
            if batch is None or batch["status"] != "in_progress":
                return batch, [], 0
            await connection.execute(
                "UPDATE batches SET status = 'cancelling', cancelling_at = $1 WHERE id = $2", now, batch_id
            )
            running = [
                row[0]
                for row in await connection.fetch(
                    "SELECT id FROM jobs WHERE batch_id = $1 AND status = 'running'", batch_id
                )
            ]
            status = await connection.execute(
                "UPDATE jobs SET status = 'cancelled', finished_at = $1, lease_owner = NULL WHERE batch_id = $2"
                " AND status IN ('queued', 'running')",
                now, batch_id,
            )  # fmt: skip
            return batch, running, int(status.split()[-1])

    async def open_batch_ids(self) -> list[str]:
        rows = await self.pool.fetch("SELECT id FROM batches WHERE status IN ('in_progress', 'cancelling')")
        return [row[0] for row in rows]

    async def finalize(self, batch_id: str, now: float, result_line: ResultLine) -> bool:
        async with self.pool.acquire() as connection, connection.transaction():
            row = await connection.fetchrow("SELECT * FROM batches WHERE id = $1 FOR UPDATE", batch_id)
            if row is None or row["status"] not in ("in_progress", "cancelling"):
                return False
            active = await connection.fetchval(
                "SELECT 1 FROM jobs WHERE batch_id = $1 AND status IN ('queued', 'running') LIMIT 1", batch_id
            )
            if active is not None:
                return False
            output: list[bytes] = []
            errors: list[bytes] = []
            expired = False
            for job_row in await connection.fetch(
                "SELECT * FROM jobs WHERE batch_id = $1 ORDER BY seq", batch_id
            ):
                job = Job.from_row(job_row)
                expired |= job.status == "expired"
                to_output, line = result_line(job)
                (output if to_output else errors).append(line)
            file_ids = []
            for lines, suffix in ((output, "output"), (errors, "error")):
                content = b"\n".join(lines) + b"\n"
                name = f"{batch_id}_{suffix}.jsonl"
                stored = (
                    await _insert_file(connection, row["key_id"], name, "batch_output", content, now)
                    if lines
                    else None
                )
                file_ids.append(None if stored is None else stored.id)
            if row["status"] == "cancelling":
                final, stamp = "cancelled", "cancelled_at"
            elif expired:
                final, stamp = "expired", "expired_at"
            else:
                final, stamp = "completed", "completed_at"
            await connection.execute(
                f"UPDATE batches SET status = $1, finalizing_at = $2, {stamp} = $2, output_file_id = $3,"
                " error_file_id = $4 WHERE id = $5",
                final, now, file_ids[0], file_ids[1], batch_id,
            )  # fmt: skip
            return True


async def _insert_file(
    connection: asyncpg.Connection, key_id: str, filename: str, purpose: str, content: bytes, now: float
) -> StoredFile:
    stored = StoredFile(new_id("file-"), key_id, filename, purpose, len(content), now)
    await connection.execute(
        "INSERT INTO files (id, key_id, filename, purpose, bytes, created_at, content) VALUES ($1, $2, $3, $4, $5, $6, $7)",
        stored.id, key_id, filename, purpose, stored.bytes, now, content,
    )  # fmt: skip
    return stored


async def _job_counts(connection: asyncpg.Connection, batch_id: str) -> dict[str, int]:
    rows = await connection.fetch(
        "SELECT status, COUNT(*) FROM jobs WHERE batch_id = $1 GROUP BY status", batch_id
    )
    return {row[0]: row[1] for row in rows}


async def _select_batch(connection: asyncpg.Connection, batch_id: str, key_id: str) -> dict[str, Any] | None:
    row = await connection.fetchrow("SELECT * FROM batches WHERE id = $1 AND key_id = $2", batch_id, key_id)
    return None if row is None else batch_object(row, await _job_counts(connection, batch_id))
