"""The admin's view of async jobs and batches, every key's, for the web console (admin key only):

    GET /admin/jobs[?status=queued|running|...][&kind=async|batch][&limit=20][&after=<job id>]
                              newest first, with their key and attempts, without results; and
                              `counts_by_status`: every job in the store (any kind) by status
    GET /admin/jobs/{id}      one job with its result or error and its webhook deliveries
    GET /admin/batches[?limit=20][&after=<batch id>]
                              every key's batches, newest first, with their request counts

Lists are pages of at most LIST_LIMIT_MAX, so a large store never answers with everything.
"""

from __future__ import annotations

from typing import Any, get_args

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from ember.gateway.admin import require_admin
from ember.gateway.errors import bad_request
from ember.gateway.jobs.batches import list_limit, list_page
from ember.gateway.jobs.runtime import JobsRuntime, not_found
from ember.gateway.jobs.store import Job, JobKind, JobStatus


def admin_job(job: Job) -> dict[str, Any]:
    """The job as its submitter sees it, plus who submitted it and which batch it belongs to."""
    return {**job.to_public(), "kind": job.kind, "key": job.owner["name"], "batch_id": job.batch_id,
            "custom_id": job.custom_id}  # fmt: skip


def job_summary(job: Job) -> dict[str, Any]:
    """A list's entry: no result (GET /admin/jobs/{id} has it) and the webhook's state without its attempts."""
    summary = admin_job(job)
    del summary["result"]
    if summary["webhook"] is not None:
        del summary["webhook"]["attempts"]
    return summary


def _choice(request: Request, name: str, allowed: tuple[str, ...]) -> Any:
    value = request.query_params.get(name)
    if value is not None and value not in allowed:
        raise bad_request(f"'{name}' must be one of {', '.join(allowed)}.", param=name)
    return value


def build_router(runtime: JobsRuntime) -> APIRouter:
    def admin_only(request: Request) -> None:
        require_admin(runtime.dispatcher, request.headers.get("authorization"))

    router = APIRouter(prefix="/admin", dependencies=[Depends(admin_only)])

    @router.get("/jobs")
    async def list_jobs(request: Request) -> Response:
        status = _choice(request, "status", get_args(JobStatus))
        kind = _choice(request, "kind", get_args(JobKind))
        limit = list_limit(request)
        jobs = await runtime.store.list_jobs(status, kind, limit + 1, request.query_params.get("after"))
        page = list_page([job_summary(job) for job in jobs], limit)
        return JSONResponse({**page, "counts_by_status": await runtime.store.count_by_status()})

    @router.get("/jobs/{job_id}")
    async def get_job(job_id: str) -> Response:
        job = await runtime.store.get_job(job_id)
        if job is None:
            raise not_found("job", job_id)
        return JSONResponse(admin_job(job))

    @router.get("/batches")
    async def list_batches(request: Request) -> Response:
        limit = list_limit(request)
        batches = await runtime.batch_store.list_batches(None, limit + 1, request.query_params.get("after"))
        return JSONResponse(list_page(batches, limit))

    return router
