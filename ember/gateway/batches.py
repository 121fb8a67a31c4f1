"""OpenAI's Batch API on the async job store: each line of the input file becomes one batch job, run by
the same worker pool (below interactive traffic); when the last one ends, the batch writes its output
and error files in OpenAI's format and completes.

    POST /v1/batches                {input_file_id, endpoint, completion_window, metadata}
    GET  /v1/batches                this key's batches, newest first (limit, after)
    GET  /v1/batches/{id}
    POST /v1/batches/{id}/cancel

Output line: {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}.
Error line: the same with the replica's or gateway's error response, or "response": null and
"error": {"code", "message"} for requests that never ran (expired, cancelled).
"""

from __future__ import annotations

import re
import sqlite3
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ember.gateway.errors import GatewayError, bad_request
from ember.gateway.files import insert_file, parse_batch_lines, select_content, select_file
from ember.gateway.jobs.api import LOWEST_PRIORITY, read_json_object
from ember.gateway.jobs.runtime import ENDPOINTS, JobsRuntime, not_found, owner_of
from ember.gateway.jobs.store import Job, JobStore, NewJob, new_id

COMPLETION_WINDOW = re.compile(r"^([1-9][0-9]{0,3})h$")
BATCH_PRIORITY = LOWEST_PRIORITY - 1  # batches run after async jobs of every priority (higher first)
ACTIVE_JOB_STATUSES = ("queued", "running")
NEVER_RAN_ERRORS = {
    "expired": ("batch_expired", "This request could not be executed before the completion window expired."),
    "cancelled": ("batch_cancelled", "This request was not executed because the batch was cancelled."),
}
LIST_LIMIT_MAX = 100


def batch_object(row: sqlite3.Row, counts: dict[str, int]) -> dict[str, Any]:
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


def job_counts(conn: sqlite3.Connection, batch_id: str) -> dict[str, int]:
    return dict(
        conn.execute("SELECT status, COUNT(*) FROM jobs WHERE batch_id = ? GROUP BY status", (batch_id,))
    )


def select_batch(conn: sqlite3.Connection, batch_id: str, key_id: str) -> dict[str, Any] | None:
    row = conn.execute("SELECT * FROM batches WHERE id = ? AND key_id = ?", (batch_id, key_id)).fetchone()
    return None if row is None else batch_object(row, job_counts(conn, batch_id))


def result_line(job: Job) -> tuple[bool, bytes]:
    """(goes to the output file?, the JSONL line) for one finished batch request."""
    if job.status in NEVER_RAN_ERRORS:
        code, message = NEVER_RAN_ERRORS[job.status]
        line = {
            "id": job.id,
            "custom_id": job.custom_id,
            "response": None,
            "error": {"code": code, "message": message},
        }
        return False, orjson.dumps(line)
    response = {"status_code": job.status_code, "request_id": job.id, "body": job.result}
    if job.result is None and job.error is not None:  # failed without any response body (gateway error)
        response["body"] = {"error": {k: v for k, v in job.error.items() if k != "status"}}
    line = {"id": job.id, "custom_id": job.custom_id, "response": response, "error": None}
    return job.status == "succeeded", orjson.dumps(line)


def finalize(conn: sqlite3.Connection, batch_id: str, now: float) -> bool:
    """Write the output/error files and close the batch once none of its requests is left to run."""
    row = conn.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
    if row is None or row["status"] not in ("in_progress", "cancelling"):
        return False
    # Called after every finished batch request: an indexed existence check, not a count.
    active = conn.execute(
        "SELECT 1 FROM jobs WHERE batch_id = ? AND status IN ('queued', 'running') LIMIT 1", (batch_id,)
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
    key_id = row["key_id"]

    def write(lines: list[bytes], suffix: str) -> str | None:
        if not lines:
            return None
        content = b"\n".join(lines) + b"\n"
        return insert_file(conn, key_id, f"{batch_id}_{suffix}.jsonl", "batch_output", content, now).id

    output_file_id, error_file_id = write(output, "output"), write(errors, "error")
    if row["status"] == "cancelling":
        final, stamp = "cancelled", "cancelled_at"
    elif expired:
        final, stamp = "expired", "expired_at"
    else:
        final, stamp = "completed", "completed_at"
    conn.execute(
        f"UPDATE batches SET status = ?, finalizing_at = ?, {stamp} = ?, output_file_id = ?, error_file_id = ?"
        " WHERE id = ?",
        (final, now, now, output_file_id, error_file_id, batch_id),
    )
    return True


class BatchFinalizer:
    """Listens for finished batch jobs and closes their batch when it was the last one."""

    def __init__(self, store: JobStore) -> None:
        self.store = store

    async def on_job_finished(self, job: Job) -> None:
        if job.batch_id is not None:
            await self.finalize(job.batch_id)

    async def finalize(self, batch_id: str) -> bool:
        now = JobsRuntime.now()
        return await self.store.transaction(lambda conn: finalize(conn, batch_id, now))

    async def finalize_open_batches(self) -> None:
        """After a restart: batches whose last job ended just before the gateway stopped."""
        ids = await self.store.transaction(
            lambda conn: [
                r[0]
                for r in conn.execute("SELECT id FROM batches WHERE status IN ('in_progress', 'cancelling')")
            ]
        )
        for batch_id in ids:
            await self.finalize(batch_id)


def build_router(runtime: JobsRuntime) -> APIRouter:
    router = APIRouter()
    finalizer = BatchFinalizer(runtime.store)
    runtime.workers.finished_listeners.append(finalizer.on_job_finished)
    runtime.startup_hooks.append(finalizer.finalize_open_batches)

    @router.post("/v1/batches")
    async def create_batch(request: Request) -> Response:
        principal = runtime.authenticate(request.headers.get("authorization"), "batch")
        body = await read_json_object(request)
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise bad_request(f"'endpoint' must be one of {', '.join(ENDPOINTS)}.", param="endpoint")
        window = body.get("completion_window")
        match = COMPLETION_WINDOW.match(window) if isinstance(window, str) else None
        if match is None:
            raise bad_request("'completion_window' must be like '24h'.", param="completion_window")
        metadata = body.get("metadata")
        if metadata is not None and not (
            isinstance(metadata, dict)
            and len(metadata) <= 16
            and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
        ):
            raise bad_request("'metadata' must map at most 16 strings to strings.", param="metadata")
        input_file_id = body.get("input_file_id")
        if not isinstance(input_file_id, str):
            raise bad_request("'input_file_id' must be a file id.", param="input_file_id")

        def read_input(conn: sqlite3.Connection) -> tuple[Any, bytes | None]:
            return select_file(conn, input_file_id, principal.key_id), select_content(
                conn, input_file_id, principal.key_id
            )

        stored, content = await runtime.store.transaction(read_input)
        if stored is None or content is None:
            raise not_found("file", input_file_id)
        if stored.purpose != "batch":
            raise bad_request(f"File '{input_file_id}' has purpose '{stored.purpose}', not 'batch'.",
                              param="input_file_id")  # fmt: skip
        lines = parse_batch_lines(content, runtime.config.batch.max_requests)
        for number, line in enumerate(lines, start=1):
            if line.url != endpoint:
                raise bad_request(
                    f"Request {number} ({line.custom_id!r}) has url {line.url!r}, but the batch endpoint is "
                    f"{endpoint!r}.",
                    param="input_file_id",
                )
        window_s = int(match.group(1)) * 3600.0
        now = runtime.now()
        batch_id = new_id("batch_")
        owner = owner_of(principal)
        specs = [
            NewJob(
                id=new_id("batch_req_"),
                key_id=principal.key_id,
                owner=owner,
                kind="batch",
                endpoint=endpoint,
                body=line.body,
                priority=BATCH_PRIORITY,
                max_time_in_queue_s=window_s,
                batch_id=batch_id,
                custom_id=line.custom_id,
            )
            for line in lines
        ]

        def create(conn: sqlite3.Connection) -> dict[str, Any]:
            conn.execute(
                "INSERT INTO batches (id, key_id, endpoint, input_file_id, completion_window, status,"
                " created_at, in_progress_at, expires_at, metadata, total)"
                " VALUES (?, ?, ?, ?, ?, 'in_progress', ?, ?, ?, ?, ?)",
                (
                    batch_id, principal.key_id, endpoint, input_file_id, window, now, now, now + window_s,
                    None if metadata is None else orjson.dumps(metadata).decode(), len(specs),
                ),
            )  # fmt: skip
            JobStore.insert_jobs(conn, specs, now)
            return select_batch(conn, batch_id, principal.key_id)

        batch = await runtime.store.transaction(create)
        runtime.metrics.submitted.labels("batch").inc(batch["request_counts"]["total"])
        runtime.workers.wake()
        return JSONResponse(batch)

    @router.get("/v1/batches")
    async def list_batches(request: Request) -> Response:
        principal = runtime.authenticate(request.headers.get("authorization"), "batch")
        limit_text = request.query_params.get("limit", "20")
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= LIST_LIMIT_MAX:
            raise bad_request(f"'limit' must be an integer in [1, {LIST_LIMIT_MAX}].", param="limit")
        limit = int(limit_text)
        after = request.query_params.get("after")

        def read(conn: sqlite3.Connection) -> list[dict[str, Any]]:
            query = "SELECT * FROM batches WHERE key_id = ?"
            params: list[Any] = [principal.key_id]
            if after:
                anchor = conn.execute(
                    "SELECT created_at, rowid FROM batches WHERE id = ? AND key_id = ?",
                    (after, principal.key_id),
                ).fetchone()
                if anchor is not None:
                    query += " AND (created_at < ? OR (created_at = ? AND rowid < ?))"
                    params += [anchor[0], anchor[0], anchor[1]]
            query += " ORDER BY created_at DESC, rowid DESC LIMIT ?"
            rows = conn.execute(query, (*params, limit + 1)).fetchall()
            return [batch_object(row, job_counts(conn, row["id"])) for row in rows]

        batches = await runtime.store.transaction(read)
        page = batches[:limit]
        return JSONResponse(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(batches) > limit,
            }
        )

    @router.get("/v1/batches/{batch_id}")
    async def get_batch(request: Request, batch_id: str) -> Response:
        principal = runtime.authenticate(request.headers.get("authorization"), "batch")
        batch = await runtime.store.transaction(lambda conn: select_batch(conn, batch_id, principal.key_id))
        if batch is None:
            raise not_found("batch", batch_id)
        return JSONResponse(batch)

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str) -> Response:
        principal = runtime.authenticate(request.headers.get("authorization"), "batch")
        now = runtime.now()

        def start_cancelling(conn: sqlite3.Connection) -> tuple[dict[str, Any] | None, list[str], int]:
            batch = select_batch(conn, batch_id, principal.key_id)
            if batch is None or batch["status"] != "in_progress":
                return batch, [], 0
            conn.execute(
                "UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ?",
                (now, batch_id),
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

        batch, running, cancelled = await runtime.store.transaction(start_cancelling)
        runtime.metrics.finished.labels("batch", "cancelled").inc(cancelled)
        if batch is None:
            raise not_found("batch", batch_id)
        if batch["status"] not in ("in_progress", "cancelling", "cancelled"):
            raise GatewayError(
                409, f"Batch '{batch_id}' is already {batch['status']}.", code="batch_not_cancellable"
            )
        for job_id in running:
            await runtime.workers.cancel_running(job_id)
        await finalizer.finalize(batch_id)
        batch = await runtime.store.transaction(lambda conn: select_batch(conn, batch_id, principal.key_id))
        return JSONResponse(batch)

    return router
