"""The worker pool that drains async and batch jobs through the gateway's normal dispatch path.

Jobs go through `Dispatcher.dispatch(..., is_background=True)`: the same keys, limits, queue and routing
as interactive traffic, but below it. `concurrency` workers each claim the most urgent queued job from
the store, run it, and record the outcome; finished jobs are handed to the webhook sender and to any
listeners (the Batch API finalizes a batch when its last request ends).

Crash safety: on start, jobs a killed gateway left `running` are re-queued while they have attempts
left, else failed with a reason. A clean stop puts running jobs back without using up an attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from ember.gateway.errors import GatewayError
from ember.gateway.jobs.config import JobsConfig
from ember.gateway.jobs.metrics import JobMetrics
from ember.gateway.jobs.store import Job, JobStore
from ember.gateway.jobs.webhooks import WebhookSender

logger = logging.getLogger("ember.gateway.jobs")

# Upstream or gateway answers worth another attempt: overload, unavailability, replica failures, and a
# gateway queue deadline on a re-run (on the first run, 408 means the job's time in queue ran out).
RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
RETRY_DELAY_S = 1.0
CLEANUP_INTERVAL_S = 60.0

FinishedListener = Callable[[Job], Awaitable[None]]


class Dispatch(Protocol):
    async def __call__(self, job: Job, deadline_s: float | None) -> tuple[int, Any]:
        """Run one job's request; (HTTP status, JSON body). Raises GatewayError when it never ran."""


def error_body(status: int, message: str, type_: str, code: str | None) -> dict[str, Any]:
    return {"message": message, "type": type_, "param": None, "code": code, "status": status}


class JobWorkerPool:
    def __init__(
        self,
        store: JobStore,
        dispatch: Dispatch,
        webhooks: WebhookSender,
        config: JobsConfig,
        metrics: JobMetrics,
    ) -> None:
        self.store = store
        self.dispatch = dispatch
        self.webhooks = webhooks
        self.config = config
        self.metrics = metrics
        self.finished_listeners: list[FinishedListener] = []
        self._wake = asyncio.Event()
        self._workers: list[asyncio.Task[None]] = []
        self._sweeper: asyncio.Task[None] | None = None
        self._running: dict[str, asyncio.Task[None]] = {}
        self._stopping = False

    async def recover(self) -> None:
        """Before anything runs: settle the jobs a killed gateway left running."""
        requeued, failed = await self.store.recover_interrupted(self.config.max_attempts)
        self.metrics.requeued.labels("restart").inc(requeued)
        if requeued or failed:
            logger.warning(
                "recovered jobs interrupted by a restart: %d re-queued, %d failed", requeued, failed
            )

    async def start(self) -> None:
        self._workers = [
            asyncio.create_task(self._work(), name=f"ember-job-worker-{index}")
            for index in range(self.config.concurrency)
        ]
        self._sweeper = asyncio.create_task(self._sweep(), name="ember-job-sweeper")

    async def stop(self) -> None:
        self._stopping = True
        tasks = [*self._workers, *([self._sweeper] if self._sweeper else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._workers, self._sweeper = [], None

    def wake(self) -> None:
        """New work was queued: let an idle worker look now rather than at its next poll."""
        self._wake.set()

    async def cancel_running(self, job_id: str) -> None:
        """Abort a running job's upstream request (the store already marked it cancelled)."""
        task = self._running.get(job_id)
        if task is not None:
            task.cancel()
            await asyncio.wait([task])

    async def _work(self) -> None:
        while True:
            try:
                await self._work_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - e.g. a full disk: keep the worker, try again shortly
                logger.exception("job worker: store operation failed")
                await asyncio.sleep(self.config.poll_interval_s)

    async def _work_once(self) -> None:
        """Claim and run one job, or wait for work."""
        job = await self.store.claim_next()
        if job is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.poll_interval_s)
            self._wake.clear()
            return
        task = asyncio.create_task(self._run(job), name=f"ember-job-{job.id}")
        self._running[job.id] = task
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            # Either cancel_running() aborted this job (carry on) or the pool is stopping.
            if self._stopping or not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await self.store.release_job(job.id)
                raise
        finally:
            self._running.pop(job.id, None)

    async def _run(self, job: Job) -> None:
        # The wait for replica capacity counts as time in queue; a re-run gets the default allowance.
        deadline_s = self.config.default_max_time_in_queue_s
        if job.attempts == 1:
            deadline_s = max(job.created_at + job.max_time_in_queue_s - time.time(), 0.001)
        retry_after_s = RETRY_DELAY_S * job.attempts
        try:
            status, body = await self.dispatch(job, deadline_s)
        except asyncio.CancelledError:
            raise
        except GatewayError as exc:
            status, body = exc.status, exc.to_dict()
            retry_after = exc.headers.get("retry-after", "")
            if retry_after.isdigit():  # a rate limit says when the key has room again
                retry_after_s = max(retry_after_s, float(retry_after))
            if exc.status == 408 and job.attempts == 1:
                await self._finish(
                    job,
                    "expired",
                    status,
                    None,
                    error_body(
                        408,
                        "The job was not started within its max_time_in_queue_seconds.",
                        "expired",
                        "max_time_in_queue_exceeded",
                    ),
                )
                return
        except Exception as exc:  # noqa: BLE001 - a job fails with a reason, it never kills its worker
            logger.exception("job %s: dispatch raised", job.id)
            status, body = (
                502,
                {"error": error_body(502, f"{type(exc).__name__}: {exc}", "server_error", None)},
            )
        if 200 <= status < 300:
            await self._finish(job, "succeeded", status, body, None)
            return
        error = body.get("error") if isinstance(body, dict) and isinstance(body.get("error"), dict) else None
        error = dict(error or error_body(status, f"upstream answered HTTP {status}", "server_error", None))
        error["status"] = status
        if status in RETRYABLE_STATUSES and job.attempts < self.config.max_attempts:
            if await self.store.requeue_job(job.id, error, time.time() + retry_after_s):
                self.metrics.requeued.labels(f"http_{status}").inc()
                return
        await self._finish(job, "failed", status, body, error)

    async def _finish(self, job: Job, status: str, status_code: int, result: Any, error: Any) -> None:
        finished = await self.store.finish_job(
            job.id,
            status,
            status_code=status_code,
            result=result,
            error=error,  # type: ignore[arg-type]
        )
        if finished is not None:
            await self._announce(finished)

    async def _announce(self, job: Job) -> None:
        self.metrics.finished.labels(job.kind, job.status).inc()
        self.webhooks.submit(job)
        for listener in self.finished_listeners:
            try:
                await listener(job)
            except Exception:  # noqa: BLE001 - one listener's failure must not lose the others
                logger.exception("job %s: finished-listener failed", job.id)

    async def _sweep(self) -> None:
        last_cleanup = 0.0
        while True:
            try:
                for job in await self.store.expire_overdue():
                    await self._announce(job)
                if time.monotonic() - last_cleanup >= CLEANUP_INTERVAL_S:
                    last_cleanup = time.monotonic()
                    await self.store.delete_expired_results(self.config.result_ttl_s)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the sweeper must outlive a failed store operation
                logger.exception("job sweeper: store operation failed")
            await asyncio.sleep(self.config.poll_interval_s)
