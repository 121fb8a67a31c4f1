"""The durable store behind async jobs, webhooks and the Batch API: one SQLite file in WAL mode.

Every statement runs on one dedicated thread (a single-worker executor), so the event loop never blocks
on disk and SQLite sees one writer. A job moves queued -> running -> succeeded | failed | expired |
cancelled; transitions are conditional updates (`... WHERE status = 'running'`), so a cancel that lands
while a job runs wins over the result that arrives later.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import secrets
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from ember.errors import EmberError

T = TypeVar("T")

JobStatus = Literal["queued", "running", "succeeded", "failed", "expired", "cancelled"]
JobKind = Literal["async", "batch"]
TERMINAL_STATUSES = ("succeeded", "failed", "expired", "cancelled")

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    key_id TEXT NOT NULL,
    owner TEXT NOT NULL,
    kind TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    body TEXT NOT NULL,
    priority INTEGER NOT NULL,
    webhook_url TEXT,
    max_time_in_queue_s REAL NOT NULL,
    queue_deadline REAL NOT NULL,
    status TEXT NOT NULL,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    run_after REAL NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0,
    status_code INTEGER,
    result TEXT,
    error TEXT,
    batch_id TEXT,
    custom_id TEXT,
    webhook_status TEXT
);
DROP INDEX IF EXISTS jobs_queue;
CREATE INDEX IF NOT EXISTS jobs_queue_urgent_first ON jobs (status, priority DESC, created_at);
CREATE INDEX IF NOT EXISTS jobs_batch_status ON jobs (batch_id, status);
CREATE INDEX IF NOT EXISTS jobs_queue_deadline ON jobs (status, queue_deadline);
CREATE INDEX IF NOT EXISTS jobs_webhook ON jobs (webhook_status);
CREATE TABLE IF NOT EXISTS webhook_attempts (
    job_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    at REAL NOT NULL,
    status_code INTEGER,
    error TEXT,
    PRIMARY KEY (job_id, attempt)
);
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    key_id TEXT NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at REAL NOT NULL,
    content BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,
    key_id TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    created_at REAL NOT NULL,
    in_progress_at REAL,
    expires_at REAL NOT NULL,
    finalizing_at REAL,
    completed_at REAL,
    failed_at REAL,
    expired_at REAL,
    cancelling_at REAL,
    cancelled_at REAL,
    output_file_id TEXT,
    error_file_id TEXT,
    metadata TEXT,
    total INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS batches_key ON batches (key_id, created_at);
CREATE TABLE IF NOT EXISTS meta (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""


class JobStoreError(EmberError):
    """The job store cannot be opened (unwritable path, or another gateway process uses it)."""


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _dumps(value: Any) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"))


@dataclass
class WebhookAttempt:
    attempt: int
    at: float
    status_code: int | None
    error: str | None

    def to_public(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "at": self.at, "status_code": self.status_code, "error": self.error}


@dataclass
class Job:
    id: str
    key_id: str
    owner: dict[str, Any]  # the caller's identity and policy at submission, to run the job as them
    kind: JobKind
    endpoint: str
    body: dict[str, Any]
    priority: int
    webhook_url: str | None
    max_time_in_queue_s: float
    status: JobStatus
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    attempts: int = 0
    status_code: int | None = None
    result: Any = None
    error: dict[str, Any] | None = None
    batch_id: str | None = None
    custom_id: str | None = None
    webhook_status: str | None = None
    webhook_attempts: list[WebhookAttempt] = field(default_factory=list)

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> Job:
        return cls(
            id=row["id"],
            key_id=row["key_id"],
            owner=json.loads(row["owner"]),
            kind=row["kind"],
            endpoint=row["endpoint"],
            body=json.loads(row["body"]),
            priority=row["priority"],
            webhook_url=row["webhook_url"],
            max_time_in_queue_s=row["max_time_in_queue_s"],
            status=row["status"],
            created_at=row["created_at"],
            started_at=row["started_at"],
            finished_at=row["finished_at"],
            attempts=row["attempts"],
            status_code=row["status_code"],
            result=_loads(row["result"]),
            error=_loads(row["error"]),
            batch_id=row["batch_id"],
            custom_id=row["custom_id"],
            webhook_status=row["webhook_status"],
        )

    def to_public(self) -> dict[str, Any]:
        """The job as GET /v1/async/jobs/{id} and the webhook payload show it."""
        return {
            "id": self.id,
            "object": "async.job",
            "endpoint": self.endpoint,
            "model": self.body.get("model"),
            "status": self.status,
            "priority": self.priority,
            "created_at": self.created_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "attempts": self.attempts,
            "max_time_in_queue_seconds": self.max_time_in_queue_s,
            "status_code": self.status_code,
            "result": self.result,
            "error": self.error,
            "webhook": None
            if self.webhook_url is None
            else {
                "url": self.webhook_url,
                "status": self.webhook_status,
                "attempts": [attempt.to_public() for attempt in self.webhook_attempts],
            },
        }


@dataclass(frozen=True)
class NewJob:
    """What a caller knows about a job before it is stored."""

    key_id: str
    owner: dict[str, Any]
    kind: JobKind
    endpoint: str
    body: dict[str, Any]
    priority: int
    max_time_in_queue_s: float
    webhook_url: str | None = None
    batch_id: str | None = None
    custom_id: str | None = None
    id: str | None = None


def queued_job(spec: NewJob, now: float) -> Job:
    """The Job a NewJob becomes when it is queued at `now` (either store's insert)."""
    return Job(
        id=spec.id or new_id("job_"),
        key_id=spec.key_id,
        owner=spec.owner,
        kind=spec.kind,
        endpoint=spec.endpoint,
        body=spec.body,
        priority=spec.priority,
        webhook_url=spec.webhook_url,
        max_time_in_queue_s=spec.max_time_in_queue_s,
        status="queued",
        created_at=now,
        batch_id=spec.batch_id,
        custom_id=spec.custom_id,
        webhook_status=None if spec.webhook_url is None else "waiting",
    )


class JobStore:
    """Async facade over one SQLite connection that lives on its own thread."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._executor: ThreadPoolExecutor | None = None
        self._conn: sqlite3.Connection | None = None
        self._lock_file: Any = None

    # -- plumbing -----------------------------------------------------------------------------

    async def open(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ember-jobstore")
        try:
            await self._submit(self._open_sync)
        except BaseException:
            self._executor.shutdown(wait=False)
            self._executor = None
            raise

    def _open_sync(self) -> None:
        # One gateway process per store: crash recovery re-queues every job left running, which would
        # steal the jobs another live process is running. The OS drops the lock when a process dies.
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            lock_file = open(self.path.with_name(self.path.name + ".lock"), "a")  # noqa: SIM115 - held open
        except OSError as exc:
            raise JobStoreError(f"cannot open the job store {self.path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.close()
            raise JobStoreError(f"the job store {self.path} is in use by another gateway process") from None
        try:
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA journal_mode=WAL")
            # A committed transaction survives a killed process in WAL mode with synchronous=NORMAL.
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA busy_timeout=5000")
            conn.executescript(SCHEMA)
        except sqlite3.Error as exc:
            lock_file.close()
            raise JobStoreError(f"cannot open the job store {self.path}: {exc}") from None
        self._conn = conn
        self._lock_file = lock_file

    async def close(self) -> None:
        if self._executor is None:
            return
        if self._conn is not None:
            await self._submit(self._conn.close)
            self._conn = None
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None
        self._executor.shutdown(wait=True)
        self._executor = None

    async def _submit(self, fn: Callable[[], T]) -> T:
        if self._executor is None:
            raise RuntimeError("the job store is not open")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def transaction(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run fn(conn) inside one IMMEDIATE transaction on the store thread."""

        def run() -> T:
            assert self._conn is not None
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                value = fn(self._conn)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
            return value

        return await self._submit(run)

    # -- jobs ---------------------------------------------------------------------------------

    @staticmethod
    def insert_jobs(conn: sqlite3.Connection, new_jobs: list[NewJob], now: float) -> list[Job]:
        jobs = [queued_job(spec, now) for spec in new_jobs]
        conn.executemany(
            "INSERT INTO jobs (id, key_id, owner, kind, endpoint, body, priority, webhook_url,"
            " max_time_in_queue_s, queue_deadline, status, created_at, batch_id, custom_id, webhook_status)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'queued', ?, ?, ?, ?)",
            [
                (
                    job.id,
                    job.key_id,
                    _dumps(job.owner),
                    job.kind,
                    job.endpoint,
                    _dumps(job.body),
                    job.priority,
                    job.webhook_url,
                    job.max_time_in_queue_s,
                    job.created_at + job.max_time_in_queue_s,
                    job.created_at,
                    job.batch_id,
                    job.custom_id,
                    job.webhook_status,
                )
                for job in jobs
            ],
        )
        return jobs

    async def create_job(self, spec: NewJob) -> Job:
        now = time.time()
        jobs = await self.transaction(lambda conn: self.insert_jobs(conn, [spec], now))
        return jobs[0]

    async def get_job(self, job_id: str) -> Job | None:
        def read(conn: sqlite3.Connection) -> Job | None:
            row = conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                return None
            job = Job.from_row(row)
            job.webhook_attempts = [
                WebhookAttempt(r["attempt"], r["at"], r["status_code"], r["error"])
                for r in conn.execute(
                    "SELECT * FROM webhook_attempts WHERE job_id = ? ORDER BY attempt", (job_id,)
                )
            ]
            return job

        return await self.transaction(read)

    async def list_jobs(
        self, status: JobStatus | None, kind: JobKind | None, limit: int, after: str | None
    ) -> list[Job]:
        """Every key's jobs (the admin's view), newest first, up to `limit`, starting after the job
        `after`; without their webhook attempts (get_job has them)."""

        def read(conn: sqlite3.Connection) -> list[Job]:
            query, params = "SELECT * FROM jobs WHERE 1 = 1", []
            for column, value in (("status", status), ("kind", kind)):
                if value is not None:
                    query += f" AND {column} = ?"
                    params.append(value)
            anchor = (
                None
                if after is None
                else conn.execute("SELECT created_at, rowid FROM jobs WHERE id = ?", (after,)).fetchone()
            )
            if anchor is not None:
                query += " AND (created_at < ? OR (created_at = ? AND rowid < ?))"
                params += [anchor[0], anchor[0], anchor[1]]
            query += " ORDER BY created_at DESC, rowid DESC LIMIT ?"
            return [Job.from_row(row) for row in conn.execute(query, (*params, limit))]

        return await self.transaction(read)

    async def expire_overdue(self, now: float | None = None) -> list[Job]:
        """Queued jobs past their max time in queue become expired; returns them (for webhooks/batches)."""
        now = time.time() if now is None else now
        error = {
            "message": "The job was not started within its max_time_in_queue_seconds.",
            "type": "expired",
            "param": None,
            "code": "max_time_in_queue_exceeded",
        }

        def expire(conn: sqlite3.Connection) -> list[Job]:
            rows = conn.execute(
                "UPDATE jobs SET status = 'expired', finished_at = ?, error = ?,"
                " webhook_status = CASE WHEN webhook_url IS NULL THEN NULL ELSE 'pending' END"
                " WHERE status = 'queued' AND queue_deadline <= ? AND started_at IS NULL"
                " RETURNING *",
                (now, _dumps(error), now),
            ).fetchall()
            return [Job.from_row(row) for row in rows]

        return await self.transaction(expire)

    async def claim_next(self, now: float | None = None) -> Job | None:
        """The most urgent runnable queued job (highest priority number, then oldest), marked running.

        A job that already ran once (re-queued after a failure or crash) no longer expires."""
        now = time.time() if now is None else now

        def claim(conn: sqlite3.Connection) -> Job | None:
            row = conn.execute(
                "UPDATE jobs SET status = 'running', started_at = ?, attempts = attempts + 1"
                " WHERE id = (SELECT id FROM jobs WHERE status = 'queued' AND run_after <= ?"
                " AND (started_at IS NOT NULL OR queue_deadline > ?)"
                " ORDER BY priority DESC, created_at, rowid LIMIT 1) RETURNING *",
                (now, now, now),
            ).fetchone()
            return None if row is None else Job.from_row(row)

        return await self.transaction(claim)

    async def finish_job(
        self,
        job_id: str,
        status: JobStatus,
        *,
        status_code: int | None = None,
        result: Any = None,
        error: dict[str, Any] | None = None,
    ) -> Job | None:
        """running -> a terminal state; None when the job is no longer running (cancelled meanwhile)."""
        now = time.time()

        def finish(conn: sqlite3.Connection) -> Job | None:
            row = conn.execute(
                "UPDATE jobs SET status = ?, finished_at = ?, status_code = ?, result = ?, error = ?,"
                " webhook_status = CASE WHEN webhook_url IS NULL THEN NULL ELSE 'pending' END"
                " WHERE id = ? AND status = 'running' RETURNING *",
                (status, now, status_code, _dumps(result), _dumps(error), job_id),
            ).fetchone()
            return None if row is None else Job.from_row(row)

        return await self.transaction(finish)

    async def requeue_job(self, job_id: str, error: dict[str, Any] | None, run_after: float = 0.0) -> bool:
        """running -> queued for another attempt (not before run_after), keeping the last error."""

        def requeue(conn: sqlite3.Connection) -> bool:
            cursor = conn.execute(
                "UPDATE jobs SET status = 'queued', error = ?, run_after = ? WHERE id = ? AND status = 'running'",
                (_dumps(error), run_after, job_id),
            )
            return cursor.rowcount == 1

        return await self.transaction(requeue)

    async def release_job(self, job_id: str) -> bool:
        """running -> queued without using up an attempt (the gateway is shutting down cleanly)."""

        def release(conn: sqlite3.Connection) -> bool:
            cursor = conn.execute(
                "UPDATE jobs SET status = 'queued', attempts = MAX(attempts - 1, 0)"
                " WHERE id = ? AND status = 'running'",
                (job_id,),
            )
            return cursor.rowcount == 1

        return await self.transaction(release)

    async def cancel_job(self, job_id: str) -> Job | None:
        """queued/running -> cancelled; returns the job as it was before (None if unknown)."""
        now = time.time()
        error = {"message": "The job was cancelled.", "type": "cancelled", "param": None, "code": "cancelled"}

        def cancel(conn: sqlite3.Connection) -> Job | None:
            row = conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                return None
            before = Job.from_row(row)
            if before.status in ("queued", "running"):  # no webhook: the client asked for the cancel
                conn.execute(
                    "UPDATE jobs SET status = 'cancelled', finished_at = ?, error = ?, webhook_status = NULL"
                    " WHERE id = ?",
                    (now, _dumps(error), job_id),
                )
            return before

        return await self.transaction(cancel)

    async def recover_interrupted(self, max_attempts: int) -> tuple[int, int]:
        """After a crash: jobs left running go back to the queue, or fail once out of attempts.

        Returns (requeued, failed)."""
        now = time.time()
        error = {
            "message": "The gateway stopped while this job was running and it has no attempts left.",
            "type": "server_error",
            "param": None,
            "code": "interrupted",
        }

        def recover(conn: sqlite3.Connection) -> tuple[int, int]:
            failed = conn.execute(
                "UPDATE jobs SET status = 'failed', finished_at = ?, error = ?,"
                " webhook_status = CASE WHEN webhook_url IS NULL THEN NULL ELSE 'pending' END"
                " WHERE status = 'running' AND attempts >= ?",
                (now, _dumps(error), max_attempts),
            ).rowcount
            requeued = conn.execute("UPDATE jobs SET status = 'queued' WHERE status = 'running'").rowcount
            return requeued, failed

        return await self.transaction(recover)

    async def count_by_status(self) -> dict[str, int]:
        def count(conn: sqlite3.Connection) -> dict[str, int]:
            return dict(conn.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall())

        return await self.transaction(count)

    # -- webhooks -----------------------------------------------------------------------------

    async def jobs_with_pending_webhooks(self) -> list[Job]:
        def read(conn: sqlite3.Connection) -> list[Job]:
            rows = conn.execute("SELECT * FROM jobs WHERE webhook_status = 'pending' ORDER BY finished_at")
            return [Job.from_row(row) for row in rows]

        return await self.transaction(read)

    async def record_webhook_attempt(
        self, job_id: str, status_code: int | None, error: str | None, final_status: str | None
    ) -> int:
        """Append one delivery attempt; final_status ('delivered' | 'failed') closes the delivery."""
        now = time.time()

        def record(conn: sqlite3.Connection) -> int:
            (attempt,) = conn.execute(
                "SELECT COALESCE(MAX(attempt), 0) + 1 FROM webhook_attempts WHERE job_id = ?", (job_id,)
            ).fetchone()
            conn.execute(
                "INSERT INTO webhook_attempts (job_id, attempt, at, status_code, error) VALUES (?, ?, ?, ?, ?)",
                (job_id, attempt, now, status_code, error),
            )
            if final_status is not None:
                conn.execute("UPDATE jobs SET webhook_status = ? WHERE id = ?", (final_status, job_id))
            return attempt

        return await self.transaction(record)

    async def webhook_attempt_count(self, job_id: str) -> int:
        def count(conn: sqlite3.Connection) -> int:
            return conn.execute(
                "SELECT COUNT(*) FROM webhook_attempts WHERE job_id = ?", (job_id,)
            ).fetchone()[0]

        return await self.transaction(count)

    # -- retention and secrets ----------------------------------------------------------------

    async def delete_expired_results(self, ttl_s: float, now: float | None = None) -> int:
        """Finished async jobs (webhook done) and finished batches with their files, older than ttl_s."""
        cutoff = (time.time() if now is None else now) - ttl_s

        def delete(conn: sqlite3.Connection) -> int:
            doomed = [
                row[0]
                for row in conn.execute(
                    "SELECT id FROM jobs WHERE kind = 'async' AND finished_at IS NOT NULL AND finished_at < ?"
                    " AND (webhook_status IS NULL OR webhook_status IN ('delivered', 'failed'))",
                    (cutoff,),
                )
            ]
            batches = conn.execute(
                "SELECT id, input_file_id, output_file_id, error_file_id FROM batches"
                " WHERE COALESCE(completed_at, failed_at, expired_at, cancelled_at) < ?",
                (cutoff,),
            ).fetchall()
            for batch in batches:
                conn.execute("DELETE FROM jobs WHERE batch_id = ?", (batch["id"],))
                for file_id in (batch["output_file_id"], batch["error_file_id"]):
                    if file_id is not None:
                        conn.execute("DELETE FROM files WHERE id = ?", (file_id,))
                conn.execute("DELETE FROM batches WHERE id = ?", (batch["id"],))
            conn.executemany(
                "DELETE FROM webhook_attempts WHERE job_id = ?", [(job_id,) for job_id in doomed]
            )
            conn.executemany("DELETE FROM jobs WHERE id = ?", [(job_id,) for job_id in doomed])
            return len(doomed) + len(batches)

        return await self.transaction(delete)

    async def meta_value(self, name: str, default_factory: Callable[[], str]) -> str:
        """A value kept in the store, created once (e.g. the generated webhook master secret)."""
        candidate = default_factory()

        def read_or_create(conn: sqlite3.Connection) -> str:
            conn.execute("INSERT OR IGNORE INTO meta (name, value) VALUES (?, ?)", (name, candidate))
            return conn.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()[0]

        return await self.transaction(read_or_create)
