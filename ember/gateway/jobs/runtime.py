"""What the async-jobs, Batch API routes share: the job store, the worker pool and the webhook sender,
wired to the gateway's dispatcher. The gateway app creates one, starts it in its lifespan and stops it
on shutdown."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember.gateway.config import KeyEndpoint, KeyPolicy
from ember.gateway.errors import GatewayError
from ember.gateway.jobs.config import AsyncConfig
from ember.gateway.jobs.metrics import JobMetrics
from ember.gateway.jobs.store import Job, JobStore
from ember.gateway.jobs.store_batches import BatchStore
from ember.gateway.jobs.webhooks import WebhookSender
from ember.gateway.jobs.worker import JobWorkerPool
from ember.gateway.keys import Principal, require_endpoint
from ember.gateway.shared.batches import SharedBatchStore
from ember.gateway.shared.jobs import SharedJobStore

if TYPE_CHECKING:
    from ember.gateway.extensions import GatewayServices

# Endpoints jobs may call, as the Batch API names them -> as the dispatcher names them.
ENDPOINTS = {"/v1/chat/completions": "chat/completions", "/v1/completions": "completions"}


def is_endpoint(value: Any) -> bool:
    """Whether a client-sent value names one of ENDPOINTS (a list or object is unhashable: not one)."""
    return isinstance(value, str) and value in ENDPOINTS


def owner_of(principal: Principal) -> dict[str, Any]:
    return {"key_id": principal.key_id, "name": principal.name, "policy": principal.policy.model_dump()}


def not_found(kind: str, object_id: str) -> GatewayError:
    return GatewayError(
        404, f"No {kind} found with id '{object_id}'.", "invalid_request_error", "not_found", "id"
    )


def revoked_submitter() -> GatewayError:
    return GatewayError(
        401, "The API key that submitted this job was revoked.", "invalid_request_error", "invalid_api_key"
    )


class JobsRuntime:
    def __init__(self, dispatcher: GatewayServices, config: AsyncConfig, base_dir: Path | None = None) -> None:
        self.dispatcher = dispatcher
        self.config = config
        # state.backend shared: jobs, files and batches in PostgreSQL, jobs leased to the gateway running them.
        self.store: JobStore | SharedJobStore
        self.batch_store: BatchStore | SharedBatchStore
        if dispatcher.shared is not None:
            self.store = SharedJobStore(dispatcher.shared, config.jobs.max_attempts)
            self.batch_store = SharedBatchStore(self.store)
        else:
            self.store = JobStore(config.store_path(base_dir))
            self.batch_store = BatchStore(self.store)  # the Files and Batch API tables of the same file
        self.metrics = JobMetrics(dispatcher.metrics.registry)
        self.webhooks = WebhookSender(self.store, config.webhooks, self.metrics)
        self.workers = JobWorkerPool(self.store, self._dispatch_job, self.webhooks, config.jobs, self.metrics)
        # Run after crash recovery, before the workers start (e.g. closing batches a crash left open).
        self.startup_hooks: list[Callable[[], Awaitable[None]]] = []

    async def start(self) -> None:
        await self.store.open()
        # Recovery first: jobs it fails get their webhooks from webhooks.start(), their batches closed
        # by the startup hooks.
        await self.workers.recover()
        for hook in self.startup_hooks:
            await hook()
        await self.webhooks.start()
        await self.workers.start()

    async def stop(self) -> None:
        await self.workers.stop()
        await self.webhooks.stop()
        await self.store.close()

    def authenticate(self, authorization: str | None, endpoint: KeyEndpoint) -> Principal:
        """The caller's key, which must be scoped to `endpoint` ("async" or "batch")."""
        principal = self.dispatcher.authenticate(authorization)
        require_endpoint(principal, endpoint)
        return principal

    def principal_for(self, job: Job) -> Principal:
        """The job's submitter, re-checked now: a key revoked since submission no longer runs jobs."""
        owner = job.owner
        keys = self.dispatcher.keys
        if keys.shared_keys is not None and not owner["key_id"].startswith("inline:"):
            principal = keys.shared_keys.live_key(owner["key_id"])
            if principal is None:
                raise revoked_submitter()
            return principal
        store = keys.store
        if store is not None and not owner["key_id"].startswith("inline:"):
            try:
                record = store.get(owner["key_id"])
            except Exception:  # noqa: BLE001 - an unknown key is treated like a revoked one
                record = None
            if record is None or record.revoked_at is not None:
                raise revoked_submitter()
            return Principal(record.id, record.name, record.policy)
        return Principal(owner["key_id"], owner["name"], KeyPolicy.model_validate(owner["policy"]))

    async def _dispatch_job(self, job: Job, deadline_s: float | None) -> tuple[int, Any]:
        principal = self.principal_for(job)
        result = await self.dispatcher.dispatch(
            principal, ENDPOINTS[job.endpoint], job.body, deadline_s=deadline_s, is_background=True
        )
        try:
            return result.status, result.json()
        finally:
            await result.aclose()

    def queue_limit_s(self, requested: Any) -> float:
        """Validated max_time_in_queue_seconds (GatewayError 400 when out of range)."""
        jobs = self.config.jobs
        if requested is None:
            return jobs.default_max_time_in_queue_s
        if (
            isinstance(requested, bool)
            or not isinstance(requested, int | float)
            or not (0 < requested <= jobs.max_time_in_queue_limit_s)
        ):
            raise GatewayError(
                400,
                f"max_time_in_queue_seconds must be a number in (0, {jobs.max_time_in_queue_limit_s:g}].",
                param="max_time_in_queue_seconds",
            )
        return float(requested)

    @staticmethod
    def now() -> float:
        return time.time()
