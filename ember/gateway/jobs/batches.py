"""OpenAI's Batch API on the async job store (its SQL in store_batches.py): each line of the input file
becomes one batch job, run by the same worker pool (below interactive traffic); when the last one
ends, the batch writes its output and error files in OpenAI's format and completes.

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
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ember.gateway.errors import GatewayError, bad_request
from ember.gateway.jobs.api import LOWEST_PRIORITY, read_json_object
from ember.gateway.jobs.files import parse_batch_lines
from ember.gateway.jobs.runtime import ENDPOINTS, JobsRuntime, is_endpoint, not_found, owner_of
from ember.gateway.jobs.store import Job, NewJob, new_id
from ember.gateway.jobs.store_batches import BatchStore, NewBatch

COMPLETION_WINDOW = re.compile(r"^([1-9][0-9]{0,3})h$")
BATCH_PRIORITY = LOWEST_PRIORITY - 1  # batches run after async jobs of every priority (higher first)
NEVER_RAN_ERRORS = {
    "expired": ("batch_expired", "This request could not be executed before the completion window expired."),
    "cancelled": ("batch_cancelled", "This request was not executed because the batch was cancelled."),
}
LIST_LIMIT_MAX = 100


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


class BatchFinalizer:
    """Listens for finished batch jobs and closes their batch when it was the last one."""

    def __init__(self, store: BatchStore) -> None:
        self.store = store

    async def on_job_finished(self, job: Job) -> None:
        if job.batch_id is not None:
            await self.finalize(job.batch_id)

    async def finalize(self, batch_id: str) -> bool:
        now = JobsRuntime.now()
        return await self.store.finalize(batch_id, now, result_line)

    async def finalize_open_batches(self) -> None:
        """After a restart: batches whose last job ended just before the gateway stopped."""
        for batch_id in await self.store.open_batch_ids():
            await self.finalize(batch_id)


def list_limit(request: Request) -> int:
    """The `limit` query parameter of a list route: 20 by default, at most LIST_LIMIT_MAX."""
    limit_text = request.query_params.get("limit", "20")
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= LIST_LIMIT_MAX:
        raise bad_request(f"'limit' must be an integer in [1, {LIST_LIMIT_MAX}].", param="limit")
    return int(limit_text)


def list_page(items: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """OpenAI's list object of the first `limit` of `items` (fetched as limit + 1, to know has_more)."""
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


def build_router(runtime: JobsRuntime) -> APIRouter:
    router = APIRouter()
    finalizer = BatchFinalizer(runtime.batch_store)
    runtime.workers.finished_listeners.append(finalizer.on_job_finished)
    runtime.startup_hooks.append(finalizer.finalize_open_batches)

    @router.post("/v1/batches")
    async def create_batch(request: Request) -> Response:
        principal = runtime.authenticate(request.headers.get("authorization"), "batch")
        body = await read_json_object(request)
        endpoint = body.get("endpoint")
        if not is_endpoint(endpoint):
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
        stored, content = await runtime.batch_store.file_with_content(input_file_id, principal.key_id)
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
        batch_id = new_id("batch_")
        owner = owner_of(principal)
        jobs = [
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
        new_batch = NewBatch(
            id=batch_id, key_id=principal.key_id, endpoint=endpoint, input_file_id=input_file_id,
            completion_window=window, window_s=window_s, metadata=metadata, jobs=jobs,
        )  # fmt: skip
        batch = await runtime.batch_store.create_batch(new_batch, runtime.now())
        runtime.metrics.submitted.labels("batch").inc(batch["request_counts"]["total"])
        runtime.workers.wake()
        return JSONResponse(batch)

    @router.get("/v1/batches")
    async def list_batches(request: Request) -> Response:
        principal = runtime.authenticate(request.headers.get("authorization"), "batch")
        limit = list_limit(request)
        batches = await runtime.batch_store.list_batches(
            principal.key_id, limit + 1, request.query_params.get("after")
        )
        return JSONResponse(list_page(batches, limit))

    @router.get("/v1/batches/{batch_id}")
    async def get_batch(request: Request, batch_id: str) -> Response:
        principal = runtime.authenticate(request.headers.get("authorization"), "batch")
        batch = await runtime.batch_store.get_batch(batch_id, principal.key_id)
        if batch is None:
            raise not_found("batch", batch_id)
        return JSONResponse(batch)

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str) -> Response:
        principal = runtime.authenticate(request.headers.get("authorization"), "batch")
        now = runtime.now()

        batch, running, cancelled = await runtime.batch_store.start_cancelling(
            batch_id, principal.key_id, now
        )
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
        batch = await runtime.batch_store.get_batch(batch_id, principal.key_id)
        return JSONResponse(batch)

    return router
