"""The async job store in PostgreSQL (`state: {backend: shared}`), for every gateway at once: the
interface of ember.gateway.jobs.store.JobStore, so the worker pool, webhooks and the jobs API run on
either unchanged.

What changes with several gateways is who may touch a running job. A worker claims a job with a lease
(`lease_owner`, `lease_expires`, claimed with `FOR UPDATE SKIP LOCKED`, so two gateways never claim
the same job) and its gateway renews the leases of everything it runs every third of
`state.postgres.job_lease_s`. Finishing, re-queueing or releasing a job needs the lease, so a gateway
that lost one (it stalled past the expiry) cannot overwrite the run that replaced it. A gateway that
dies stops renewing: once its leases expire, any gateway's sweeper re-queues those jobs (or fails
those out of attempts), and their workers run them again: at-least-once. Webhook deliveries are
leased the same way, so a delivery cut short by a dead gateway resumes on another with the same
webhook-id and its attempts counted.

Files and batches: ember.gateway.shared.batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import asyncpg

from ember.gateway.jobs.store import Job, JobKind, JobStatus, NewJob, WebhookAttempt, queued_job
from ember.gateway.shared.connection import POSTGRES_ERRORS, SharedState

logger = logging.getLogger(__name__)

_INTERRUPTED = {
    "message": "The gateway running this job stopped and the job has no attempts left.",
    "type": "server_error",
    "param": None,
    "code": "interrupted",
}
_EXPIRED = {
    "message": "The job was not started within its max_time_in_queue_seconds.",
    "type": "expired",
    "param": None,
    "code": "max_time_in_queue_exceeded",
}
_CANCELLED = {"message": "The job was cancelled.", "type": "cancelled", "param": None, "code": "cancelled"}
# A finished job's webhook becomes pending, leased to the gateway that finished it.
_WEBHOOK_PENDING = (
    "webhook_status = CASE WHEN webhook_url IS NULL THEN NULL ELSE 'pending' END,"
    " webhook_owner = CASE WHEN webhook_url IS NULL THEN NULL ELSE $owner::text END,"
    " webhook_lease_expires = CASE WHEN webhook_url IS NULL THEN NULL ELSE $lease::double precision END"
)


def _dumps(value: Any) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"))


def _sql(text: str, **names: int) -> str:
    """`text` with $owner/$lease-style names replaced by the positional parameters asyncpg expects."""
    for name, position in sorted(names.items(), key=lambda item: -len(item[0])):
        text = text.replace(f"${name}", f"${position}")
    return text


async def insert_jobs(connection: asyncpg.Connection, specs: list[NewJob], now: float) -> list[Job]:
    """Queue `specs` (one async job, or a batch's requests inside the batch's transaction)."""
    jobs = [queued_job(spec, now) for spec in specs]
    await connection.executemany(
        "INSERT INTO jobs (id, key_id, owner, kind, endpoint, body, priority, webhook_url, max_time_in_queue_s,"
        " queue_deadline, status, created_at, batch_id, custom_id, webhook_status)"
        " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, 'queued', $11, $12, $13, $14)",
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
                now + job.max_time_in_queue_s,
                now,
                job.batch_id,
                job.custom_id,
                job.webhook_status,
            )  # fmt: skip
            for job in jobs
        ],
    )
    return jobs


class SharedJobStore:
    def __init__(self, state: SharedState, max_attempts: int) -> None:
        self.state = state
        self.max_attempts = max_attempts  # jobs.max_attempts: a lapsed job past it fails instead
        self.lease_s = state.config.postgres.job_lease_s
        # This process's name on the leases it holds; unique per start, so a restarted gateway does not
        # mistake its predecessor's expired leases for its own.
        self.owner_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._renewer: asyncio.Task | None = None

    @property
    def pool(self) -> asyncpg.Pool:
        return self.state.pool

    def _lease(self, now: float) -> float:
        return now + self.lease_s

    # -- plumbing -----------------------------------------------------------------------------

    async def open(self) -> None:
        self._renewer = asyncio.create_task(self._renew_leases(), name="ember-job-lease-renewer")

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
            self._renewer = None

    async def _renew_leases(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            now = time.time()
            try:
                await self.pool.execute(
                    "UPDATE jobs SET lease_expires = $2 WHERE lease_owner = $1 AND status = 'running'",
                    self.owner_id, self._lease(now),
                )  # fmt: skip
                await self.pool.execute(
                    "UPDATE jobs SET webhook_lease_expires = $2 WHERE webhook_owner = $1 AND webhook_status = 'pending'",
                    self.owner_id, self._lease(now),
                )  # fmt: skip
            except (OSError, *POSTGRES_ERRORS) as exc:  # renew again next time; the leases outlast a blip
                logger.warning("could not renew job leases: %s", exc)

    # -- jobs ---------------------------------------------------------------------------------

    async def create_job(self, spec: NewJob) -> Job:
        async with self.pool.acquire() as connection:
            jobs = await insert_jobs(connection, [spec], time.time())
        return jobs[0]

    async def get_job(self, job_id: str) -> Job | None:
        async with self.pool.acquire() as connection:
            row = await connection.fetchrow("SELECT * FROM jobs WHERE id = $1", job_id)
            if row is None:
                return None
            job = Job.from_row(row)
            attempts = await connection.fetch(
                "SELECT * FROM webhook_attempts WHERE job_id = $1 ORDER BY attempt", job_id
            )
        job.webhook_attempts = [
            WebhookAttempt(r["attempt"], r["at"], r["status_code"], r["error"]) for r in attempts
        ]
        return job

    async def list_jobs(
        self, status: JobStatus | None, kind: JobKind | None, limit: int, after: str | None
    ) -> list[Job]:
        """As JobStore.list_jobs: every key's jobs, newest first, after the job `after`."""
        async with self.pool.acquire() as connection:
            anchor = None
            if after is not None:
                anchor = await connection.fetchrow("SELECT created_at, seq FROM jobs WHERE id = $1", after)
            rows = await connection.fetch(
                "SELECT * FROM jobs WHERE ($1::text IS NULL OR status = $1) AND ($2::text IS NULL OR kind = $2)"
                " AND ($3::double precision IS NULL OR (created_at, seq) < ($3, $4))"
                " ORDER BY created_at DESC, seq DESC LIMIT $5",
                status, kind, None if anchor is None else anchor["created_at"],
                None if anchor is None else anchor["seq"], limit,
            )  # fmt: skip
        return [Job.from_row(row) for row in rows]

    async def expire_overdue(self, now: float | None = None) -> list[Job]:
        """The sweeper's pass: queued jobs past their max time in queue expire, and jobs whose lease
        lapsed (their gateway died) are re-queued. Returns the jobs that reached a final state here."""
        now = time.time() if now is None else now
        rows = await self.pool.fetch(
            _sql(
                f"UPDATE jobs SET status = 'expired', finished_at = $now, error = $error, {_WEBHOOK_PENDING}"
                " WHERE status = 'queued' AND queue_deadline <= $now AND started_at IS NULL RETURNING *",
                now=1, error=2, owner=3, lease=4,
            ),
            now, _dumps(_EXPIRED), self.owner_id, self._lease(now),
        )  # fmt: skip
        _, failed = await self._take_over_lapsed(now)
        return [Job.from_row(row) for row in rows] + failed

    async def _take_over_lapsed(self, now: float) -> tuple[int, list[Job]]:
        """Running jobs whose lease expired: failed when out of attempts (returned, to be announced),
        else queued again for any gateway's workers. Returns (re-queued count, failed jobs)."""
        async with self.pool.acquire() as connection, connection.transaction():
            failed = await connection.fetch(
                _sql(
                    f"UPDATE jobs SET status = 'failed', finished_at = $now, error = $error, lease_owner = NULL,"
                    f" {_WEBHOOK_PENDING} WHERE status = 'running' AND lease_expires < $now AND attempts >= $max"
                    " RETURNING *",
                    now=1, error=2, owner=3, lease=4, max=5,
                ),
                now, _dumps(_INTERRUPTED), self.owner_id, self._lease(now), self.max_attempts,
            )  # fmt: skip
            requeued = await connection.execute(
                "UPDATE jobs SET status = 'queued', lease_owner = NULL WHERE status = 'running' AND lease_expires < $1",
                now,
            )
        count = int(requeued.split()[-1])
        if count or failed:
            logger.warning("took over jobs of a stopped gateway: %d re-queued, %d failed", count, len(failed))
        return count, [Job.from_row(row) for row in failed]

    async def claim_next(self, now: float | None = None) -> Job | None:
        now = time.time() if now is None else now
        row = await self.pool.fetchrow(
            "UPDATE jobs SET status = 'running', started_at = $1, attempts = attempts + 1, lease_owner = $2,"
            " lease_expires = $3 WHERE id = (SELECT id FROM jobs WHERE status = 'queued' AND run_after <= $1"
            " AND (started_at IS NOT NULL OR queue_deadline > $1)"
            " ORDER BY priority DESC, created_at, seq LIMIT 1 FOR UPDATE SKIP LOCKED) RETURNING *",
            now, self.owner_id, self._lease(now),
        )  # fmt: skip
        return None if row is None else Job.from_row(row)

    async def finish_job(
        self,
        job_id: str,
        status: JobStatus,
        *,
        status_code: int | None = None,
        result: Any = None,
        error: dict[str, Any] | None = None,
    ) -> Job | None:
        """running (under this gateway's lease) -> a terminal state; None when the job is no longer ours."""
        now = time.time()
        row = await self.pool.fetchrow(
            _sql(
                "UPDATE jobs SET status = $status, finished_at = $now, status_code = $code, result = $result,"
                f" error = $error, lease_owner = NULL, {_WEBHOOK_PENDING}"
                " WHERE id = $id AND status = 'running' AND lease_owner = $owner RETURNING *",
                status=1, now=2, code=3, result=4, error=5, id=6, owner=7, lease=8,
            ),
            status, now, status_code, _dumps(result), _dumps(error), job_id, self.owner_id, self._lease(now),
        )  # fmt: skip
        return None if row is None else Job.from_row(row)

    async def requeue_job(self, job_id: str, error: dict[str, Any] | None, run_after: float = 0.0) -> bool:
        status = await self.pool.execute(
            "UPDATE jobs SET status = 'queued', error = $1, run_after = $2, lease_owner = NULL"
            " WHERE id = $3 AND status = 'running' AND lease_owner = $4",
            _dumps(error), run_after, job_id, self.owner_id,
        )  # fmt: skip
        return status == "UPDATE 1"

    async def release_job(self, job_id: str) -> bool:
        status = await self.pool.execute(
            "UPDATE jobs SET status = 'queued', attempts = GREATEST(attempts - 1, 0), lease_owner = NULL"
            " WHERE id = $1 AND status = 'running' AND lease_owner = $2",
            job_id, self.owner_id,
        )  # fmt: skip
        return status == "UPDATE 1"

    async def cancel_job(self, job_id: str) -> Job | None:
        now = time.time()
        async with self.pool.acquire() as connection, connection.transaction():
            row = await connection.fetchrow("SELECT * FROM jobs WHERE id = $1 FOR UPDATE", job_id)
            if row is None:
                return None
            before = Job.from_row(row)
            if before.status in ("queued", "running"):  # no webhook: the client asked for the cancel
                await connection.execute(
                    "UPDATE jobs SET status = 'cancelled', finished_at = $1, error = $2, webhook_status = NULL,"
                    " lease_owner = NULL WHERE id = $3",
                    now, _dumps(_CANCELLED), job_id,
                )  # fmt: skip
        return before

    async def recover_interrupted(self, max_attempts: int) -> tuple[int, int]:
        """At start: take over the jobs of gateways whose leases lapsed (never those of live gateways).
        Returns (requeued, failed); the failed ones' webhooks are pending and resumed by the sender."""
        requeued, failed = await self._take_over_lapsed(time.time())
        return requeued, len(failed)

    async def count_by_status(self) -> dict[str, int]:
        rows = await self.pool.fetch("SELECT status, COUNT(*) FROM jobs GROUP BY status")
        return {row[0]: row[1] for row in rows}

    # -- webhooks -----------------------------------------------------------------------------

    async def jobs_with_pending_webhooks(self) -> list[Job]:
        """Pending deliveries this gateway now holds: its own, and those whose gateway's lease lapsed."""
        now = time.time()
        rows = await self.pool.fetch(
            "UPDATE jobs SET webhook_owner = $1, webhook_lease_expires = $2 WHERE id IN (SELECT id FROM jobs"
            " WHERE webhook_status = 'pending' AND (webhook_owner = $1 OR webhook_owner IS NULL"
            " OR webhook_lease_expires < $3) ORDER BY finished_at FOR UPDATE SKIP LOCKED) RETURNING *",
            self.owner_id, self._lease(now), now,
        )  # fmt: skip
        return sorted((Job.from_row(row) for row in rows), key=lambda job: job.finished_at or 0)

    async def record_webhook_attempt(
        self, job_id: str, status_code: int | None, error: str | None, final_status: str | None
    ) -> int:
        now = time.time()
        async with self.pool.acquire() as connection, connection.transaction():
            # Row lock: two deliveries of one job (a lease taken over mid-attempt) number attempts in turn.
            await connection.execute("SELECT 1 FROM jobs WHERE id = $1 FOR UPDATE", job_id)
            attempt = await connection.fetchval(
                "SELECT COALESCE(MAX(attempt), 0) + 1 FROM webhook_attempts WHERE job_id = $1", job_id
            )
            await connection.execute(
                "INSERT INTO webhook_attempts (job_id, attempt, at, status_code, error) VALUES ($1, $2, $3, $4, $5)",
                job_id, attempt, now, status_code, error,
            )  # fmt: skip
            if final_status is not None:
                await connection.execute(
                    "UPDATE jobs SET webhook_status = $1, webhook_owner = NULL WHERE id = $2",
                    final_status,
                    job_id,
                )
        return attempt

    async def webhook_attempt_count(self, job_id: str) -> int:
        return await self.pool.fetchval("SELECT COUNT(*) FROM webhook_attempts WHERE job_id = $1", job_id)

    # -- retention and secrets ----------------------------------------------------------------

    async def delete_expired_results(self, ttl_s: float, now: float | None = None) -> int:
        """Finished async jobs (webhook done) and finished batches with their jobs and files, older than ttl_s."""
        cutoff = (time.time() if now is None else now) - ttl_s
        async with self.pool.acquire() as connection, connection.transaction():
            doomed = await connection.fetch(
                "DELETE FROM jobs WHERE kind = 'async' AND finished_at IS NOT NULL AND finished_at < $1"
                " AND (webhook_status IS NULL OR webhook_status IN ('delivered', 'failed')) RETURNING id",
                cutoff,
            )
            await connection.execute(
                "DELETE FROM webhook_attempts WHERE job_id = ANY($1::text[])", [row[0] for row in doomed]
            )
            batches = await connection.fetch(
                "DELETE FROM batches WHERE COALESCE(completed_at, failed_at, expired_at, cancelled_at) < $1"
                " RETURNING id, output_file_id, error_file_id",
                cutoff,
            )
            await connection.execute(
                "DELETE FROM jobs WHERE batch_id = ANY($1::text[])", [row[0] for row in batches]
            )
            files = [file_id for row in batches for file_id in (row[1], row[2]) if file_id is not None]
            await connection.execute("DELETE FROM files WHERE id = ANY($1::text[])", files)
        return len(doomed) + len(batches)

    async def meta_value(self, name: str, default_factory: Callable[[], str]) -> str:
        """A value created once for all gateways (e.g. the webhook master secret: every gateway signs alike)."""
        await self.pool.execute(
            "INSERT INTO meta (name, value) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING",
            name,
            default_factory(),
        )
        return await self.pool.fetchval("SELECT value FROM meta WHERE name = $1", name)
