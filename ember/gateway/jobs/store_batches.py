"""The Files and Batch API tables of the job store (`files`, `batches`; schema in store.py): every
statement the two APIs run, each call one transaction on the store's thread. Files are returned as
`StoredFile`s, batches as OpenAI batch objects (dicts), ready to answer with."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from ember.gateway.jobs.store import Job, JobStore, NewJob, new_id

# (goes to the output file rather than the error file?, the JSONL line) for one finished batch request.
ResultLine = Callable[[Job], tuple[bool, bytes]]


@dataclass(frozen=True)
class StoredFile:
    id: str
    key_id: str
    filename: str
    purpose: str
    bytes: int
    created_at: float

    def to_public(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": int(self.created_at),
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": None,
        }


@dataclass(frozen=True)
class NewBatch:
    """A batch as POST /v1/batches validated it, before it is stored with its jobs."""

    id: str
    key_id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    window_s: float
    metadata: dict[str, str] | None
    jobs: list[NewJob]


class BatchStore:
    """Files and batches, kept in the same SQLite file (and transactions) as the jobs of the batches."""

    def __init__(self, store: JobStore) -> None:
        self.store = store

    # -- files --------------------------------------------------------------------------------

    async def add_file(
        self, key_id: str, filename: str, purpose: str, content: bytes, now: float
    ) -> StoredFile:
        return await self.store.transaction(
            lambda conn: _insert_file(conn, key_id, filename, purpose, content, now)
        )

    async def list_files(self, key_id: str) -> list[StoredFile]:
        def read(conn: sqlite3.Connection) -> list[StoredFile]:
            rows = conn.execute(
                f"SELECT {_FILE_COLUMNS} FROM files WHERE key_id = ? ORDER BY created_at DESC, rowid DESC",
                (key_id,),
            )
            return [stored_file(row) for row in rows]

        return await self.store.transaction(read)

    async def get_file(self, file_id: str, key_id: str) -> StoredFile | None:
        return await self.store.transaction(lambda conn: _select_file(conn, file_id, key_id))

    async def file_content(self, file_id: str, key_id: str) -> bytes | None:
        return await self.store.transaction(lambda conn: _select_content(conn, file_id, key_id))

    async def file_with_content(self, file_id: str, key_id: str) -> tuple[StoredFile | None, bytes | None]:
        return await self.store.transaction(
            lambda conn: (_select_file(conn, file_id, key_id), _select_content(conn, file_id, key_id))
        )

    async def delete_file(self, file_id: str, key_id: str) -> bool:
        def delete(conn: sqlite3.Connection) -> bool:
            return (
                conn.execute("DELETE FROM files WHERE id = ? AND key_id = ?", (file_id, key_id)).rowcount > 0
            )

        return await self.store.transaction(delete)

    # -- batches ------------------------------------------------------------------------------

    async def create_batch(self, batch: NewBatch, now: float) -> dict[str, Any]:
        """The batch and all its jobs, stored at once (in progress from the start)."""

        def create(conn: sqlite3.Connection) -> dict[str, Any]:
            conn.execute(
                "INSERT INTO batches (id, key_id, endpoint, input_file_id, completion_window, status,"
                " created_at, in_progress_at, expires_at, metadata, total)"
                " VALUES (?, ?, ?, ?, ?, 'in_progress', ?, ?, ?, ?, ?)",
                (
                    batch.id, batch.key_id, batch.endpoint, batch.input_file_id, batch.completion_window, now, now,
                    now + batch.window_s, None if batch.metadata is None else orjson.dumps(batch.metadata).decode(),
                    len(batch.jobs),
                ),
            )  # fmt: skip
            JobStore.insert_jobs(conn, batch.jobs, now)
            return _select_batch(conn, batch.id, batch.key_id)

        return await self.store.transaction(create)

    async def get_batch(self, batch_id: str, key_id: str) -> dict[str, Any] | None:
        return await self.store.transaction(lambda conn: _select_batch(conn, batch_id, key_id))

    async def list_batches(self, key_id: str | None, limit: int, after: str | None) -> list[dict[str, Any]]:
        """Up to `limit` batches, newest first, starting after the batch `after` (when it is this key's);
        `key_id` None: every key's batches (the admin's view)."""

        def read(conn: sqlite3.Connection) -> list[dict[str, Any]]:
            query = "SELECT * FROM batches WHERE (? IS NULL OR key_id = ?)"
            params: list[Any] = [key_id, key_id]
            if after:
                anchor = conn.execute(
                    "SELECT created_at, rowid FROM batches WHERE id = ? AND (? IS NULL OR key_id = ?)",
                    (after, key_id, key_id),
                ).fetchone()
                if anchor is not None:
                    query += " AND (created_at < ? OR (created_at = ? AND rowid < ?))"
                    params += [anchor[0], anchor[0], anchor[1]]
            query += " ORDER BY created_at DESC, rowid DESC LIMIT ?"
            rows = conn.execute(query, (*params, limit)).fetchall()
            return [batch_object(row, _job_counts(conn, row["id"])) for row in rows]

        return await self.store.transaction(read)

    async def start_cancelling(
        self, batch_id: str, key_id: str, now: float
    ) -> tuple[dict[str, Any] | None, list[str], int]:
        """An in-progress batch becomes 'cancelling' and its unfinished jobs 'cancelled'.

        Returns (the batch as it was, or None if unknown; ids of its jobs that were running, which
        the caller stops; the number of jobs cancelled)."""

        def cancel(conn: sqlite3.Connection) -> tuple[dict[str, Any] | None, list[str], int]:
            batch = _select_batch(conn, batch_id, key_id)
            if batch is None or batch["status"] != "in_progress":
                return batch, [], 0
            conn.execute(
                "UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ?", (now, batch_id)
            )
            running = [r[0] for r in conn.execute(
                "SELECT id FROM jobs WHERE batch_id = ? AND status = 'running'", (batch_id,)
            )]  # fmt: skip
            cancelled = conn.execute(
                "UPDATE jobs SET status = 'cancelled', finished_at = ? WHERE batch_id = ?"
                " AND status IN ('queued', 'running')",
                (now, batch_id),
            ).rowcount
            return batch, running, cancelled

        return await self.store.transaction(cancel)

    async def open_batch_ids(self) -> list[str]:
        """Batches not yet closed (in progress or cancelling)."""
        return await self.store.transaction(
            lambda conn: [
                row[0]
                for row in conn.execute(
                    "SELECT id FROM batches WHERE status IN ('in_progress', 'cancelling')"
                )
            ]
        )

    async def finalize(self, batch_id: str, now: float, result_line: ResultLine) -> bool:
        """Write the output/error files and close the batch once none of its requests is left to run.

        `result_line` renders each finished request; returns whether the batch was closed now."""

        def finalize(conn: sqlite3.Connection) -> bool:
            row = conn.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None or row["status"] not in ("in_progress", "cancelling"):
                return False
            # Called after every finished batch request: an indexed existence check, not a count.
            active = conn.execute(
                "SELECT 1 FROM jobs WHERE batch_id = ? AND status IN ('queued', 'running') LIMIT 1",
                (batch_id,),
            ).fetchone()
            if active is not None:
                return False
            output: list[bytes] = []
            errors: list[bytes] = []
            expired = False
            for job_row in conn.execute("SELECT * FROM jobs WHERE batch_id = ? ORDER BY rowid", (batch_id,)):
                job = Job.from_row(job_row)
                expired |= job.status == "expired"
                to_output, line = result_line(job)
                (output if to_output else errors).append(line)

            def write(lines: list[bytes], suffix: str) -> str | None:
                if not lines:
                    return None
                content = b"\n".join(lines) + b"\n"
                return _insert_file(
                    conn, row["key_id"], f"{batch_id}_{suffix}.jsonl", "batch_output", content, now
                ).id

            output_file_id, error_file_id = write(output, "output"), write(errors, "error")
            if row["status"] == "cancelling":
                final, stamp = "cancelled", "cancelled_at"
            elif expired:
                final, stamp = "expired", "expired_at"
            else:
                final, stamp = "completed", "completed_at"
            conn.execute(
                f"UPDATE batches SET status = ?, finalizing_at = ?, {stamp} = ?, output_file_id = ?,"
                " error_file_id = ? WHERE id = ?",
                (final, now, now, output_file_id, error_file_id, batch_id),
            )
            return True

        return await self.store.transaction(finalize)


_FILE_COLUMNS = "id, key_id, filename, purpose, bytes, created_at"


def stored_file(row: sqlite3.Row) -> StoredFile:
    return StoredFile(
        row["id"], row["key_id"], row["filename"], row["purpose"], row["bytes"], row["created_at"]
    )


def _insert_file(
    conn: sqlite3.Connection, key_id: str, filename: str, purpose: str, content: bytes, now: float
) -> StoredFile:
    stored = StoredFile(new_id("file-"), key_id, filename, purpose, len(content), now)
    conn.execute(
        "INSERT INTO files (id, key_id, filename, purpose, bytes, created_at, content) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (stored.id, key_id, filename, purpose, stored.bytes, now, content),
    )
    return stored


def _select_file(conn: sqlite3.Connection, file_id: str, key_id: str) -> StoredFile | None:
    row = conn.execute(
        f"SELECT {_FILE_COLUMNS} FROM files WHERE id = ? AND key_id = ?", (file_id, key_id)
    ).fetchone()
    return None if row is None else stored_file(row)


def _select_content(conn: sqlite3.Connection, file_id: str, key_id: str) -> bytes | None:
    row = conn.execute("SELECT content FROM files WHERE id = ? AND key_id = ?", (file_id, key_id)).fetchone()
    return None if row is None else bytes(row[0])


def _job_counts(conn: sqlite3.Connection, batch_id: str) -> dict[str, int]:
    return dict(
        conn.execute("SELECT status, COUNT(*) FROM jobs WHERE batch_id = ? GROUP BY status", (batch_id,))
    )


def _select_batch(conn: sqlite3.Connection, batch_id: str, key_id: str) -> dict[str, Any] | None:
    row = conn.execute("SELECT * FROM batches WHERE id = ? AND key_id = ?", (batch_id, key_id)).fetchone()
    return None if row is None else batch_object(row, _job_counts(conn, batch_id))


def batch_object(row: sqlite3.Row, counts: dict[str, int]) -> dict[str, Any]:
    """The OpenAI batch object of a `batches` row, with request counts from its jobs' statuses."""

    def ts(name: str) -> int | None:
        return None if row[name] is None else int(row[name])

    return {
        "id": row["id"],
        "object": "batch",
        "endpoint": row["endpoint"],
        "errors": None,
        "input_file_id": row["input_file_id"],
        "completion_window": row["completion_window"],
        "status": row["status"],
        "output_file_id": row["output_file_id"],
        "error_file_id": row["error_file_id"],
        "created_at": ts("created_at"),
        "in_progress_at": ts("in_progress_at"),
        "expires_at": ts("expires_at"),
        "finalizing_at": ts("finalizing_at"),
        "completed_at": ts("completed_at"),
        "failed_at": ts("failed_at"),
        "expired_at": ts("expired_at"),
        "cancelling_at": ts("cancelling_at"),
        "cancelled_at": ts("cancelled_at"),
        "request_counts": {
            "total": row["total"],
            "completed": counts.get("succeeded", 0),
            "failed": counts.get("failed", 0) + counts.get("expired", 0),
        },
        "metadata": orjson.loads(row["metadata"]) if row["metadata"] else None,
    }
