"""HTTP routes of async jobs (Baseten's async contract):

    POST   /v1/async/chat/completions   normal body + webhook_url, priority (0 .. 2, higher first), 202 {id, status}
    POST   /v1/async/completions          max_time_in_queue_seconds
    GET    /v1/async/jobs/{id}            status, result or error, webhook attempts
    DELETE /v1/async/jobs/{id}            cancel a queued or running job
    GET    /v1/async/webhook-secret       this key's whsec_ secret, to verify webhook signatures

A key sees only its own jobs: another key's job id answers 404, like an unknown one. Routes here (and
in files.py, batches.py) raise GatewayError; the gateway app renders it in OpenAI's error shape.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ember.gateway.errors import GatewayError, bad_request
from ember.gateway.jobs.runtime import ENDPOINTS, JobsRuntime, not_found, owner_of
from ember.gateway.jobs.store import NewJob
from ember.gateway.jobs.webhooks import WebhookURLError
from ember.gateway.request_body import parse_json_object, parse_request_body

# Ember's convention (ember.gateway.priority): a higher number is claimed first.
LOWEST_PRIORITY, DEFAULT_PRIORITY, HIGHEST_PRIORITY = 0, 1, 2


async def read_json_object(request: Request) -> dict[str, Any]:
    return parse_json_object(await request.body())


def validate_request_body(body: dict[str, Any], endpoint: str, known_models: Any, allowed: Any) -> None:
    """What can be checked before queueing: the fields the gateway reads have their types, the model
    exists and is allowed to the key, no streaming."""
    request = parse_request_body(ENDPOINTS[endpoint], body)
    if request.model not in known_models:
        raise GatewayError(
            404, f"The model `{request.model}` does not exist.", code="model_not_found", param="model"
        )
    if request.stream:
        raise bad_request(
            "Async and batch requests cannot be streamed; leave 'stream' unset.", param="stream"
        )
    if not allowed(request.model):
        raise GatewayError(
            403,
            f"This API key may not use model '{request.model}'.",
            "permission_error",
            "model_not_allowed",
            "model",
        )


def build_router(runtime: JobsRuntime) -> APIRouter:
    router = APIRouter()

    async def submit(request: Request, endpoint: str) -> Response:
        principal = runtime.authenticate(request.headers.get("authorization"), "async")
        body = await read_json_object(request)
        webhook_url = body.pop("webhook_url", None)
        priority = body.pop("priority", DEFAULT_PRIORITY)
        queue_limit = runtime.queue_limit_s(body.pop("max_time_in_queue_seconds", None))
        if isinstance(priority, bool) or not isinstance(priority, int) or not LOWEST_PRIORITY <= priority <= HIGHEST_PRIORITY:
            raise bad_request(
                f"priority must be an integer from {LOWEST_PRIORITY} to {HIGHEST_PRIORITY} (higher runs first; "
                f"default {DEFAULT_PRIORITY}).",
                param="priority",
            )
        if webhook_url is not None:
            try:
                await runtime.webhooks.guard.resolve(webhook_url)
            except WebhookURLError as exc:
                raise bad_request(str(exc), param="webhook_url", code="invalid_webhook_url") from None
        validate_request_body(body, endpoint, runtime.dispatcher.config.models, principal.policy.allows_model)
        job = await runtime.store.create_job(
            NewJob(
                key_id=principal.key_id,
                owner=owner_of(principal),
                kind="async",
                endpoint=endpoint,
                body=body,
                priority=priority,
                max_time_in_queue_s=queue_limit,
                webhook_url=webhook_url,
            )
        )
        runtime.metrics.submitted.labels("async").inc()
        runtime.workers.wake()
        return JSONResponse(
            {"id": job.id, "object": "async.job", "status": job.status, "created_at": job.created_at},
            status_code=202,
        )

    @router.post("/v1/async/chat/completions")
    async def submit_chat(request: Request) -> Response:
        return await submit(request, "/v1/chat/completions")

    @router.post("/v1/async/completions")
    async def submit_completion(request: Request) -> Response:
        return await submit(request, "/v1/completions")

    async def owned_job(request: Request, job_id: str):
        principal = runtime.authenticate(request.headers.get("authorization"), "async")
        job = await runtime.store.get_job(job_id)
        if job is None or job.kind != "async" or job.key_id != principal.key_id:
            raise not_found("job", job_id)
        return job

    @router.get("/v1/async/jobs/{job_id}")
    async def get_job(request: Request, job_id: str) -> Response:
        job = await owned_job(request, job_id)
        return JSONResponse(job.to_public())

    @router.delete("/v1/async/jobs/{job_id}")
    async def cancel_job(request: Request, job_id: str) -> Response:
        job = await owned_job(request, job_id)
        before = await runtime.store.cancel_job(job.id)
        if before is None or before.is_terminal:
            raise GatewayError(
                409,
                f"Job '{job_id}' already finished with status '{(before or job).status}'.",
                "invalid_request_error",
                "job_not_cancellable",
                "id",
            )
        runtime.metrics.finished.labels("async", "cancelled").inc()
        if before.status == "running":
            await runtime.workers.cancel_running(job.id)
        job = await runtime.store.get_job(job.id)
        return JSONResponse(job.to_public())

    @router.get("/v1/async/webhook-secret")
    async def webhook_secret(request: Request) -> Response:
        principal = runtime.authenticate(request.headers.get("authorization"), "async")
        return JSONResponse(
            {"object": "webhook.secret", "secret": runtime.webhooks.secret_for(principal.key_id)}
        )

    return router
