"""How the job workers treat failures, through the real gateway and a scripted upstream: retry on
replica failures up to max_attempts, no retry on a client error, and a revoked key stops its jobs."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from gateway_harness import FakeReplica, wait_until
from protocols_support import ProtocolGateway, WebhookReceiver, auth, protocol_config

from ember.gateway.config import KeyPolicy
from ember.gateway.jobs.store import JobStore, NewJob
from ember.gateway.keys import KeyStore


@pytest.fixture
def replica():
    replica = FakeReplica("r").start()
    yield replica
    replica.release()
    replica.stop()


def start(replica: FakeReplica, tmp_path, max_attempts: int = 3, **extra) -> ProtocolGateway:
    config = protocol_config([replica.url], **extra)
    config["async"]["jobs"] = {"concurrency": 1, "poll_interval_s": 0.05, "max_attempts": max_attempts}
    return ProtocolGateway(config, tmp_path).start()


def submit(client: httpx.Client, headers: dict | None = None) -> str:
    response = client.post(
        "/v1/async/completions",
        headers=headers or auth(),
        json={"model": "tiny", "prompt": "p", "max_tokens": 2},
    )
    assert response.status_code == 202, response.text
    return response.json()["id"]


def job_of(client: httpx.Client, job_id: str, headers: dict | None = None) -> dict:
    return client.get(f"/v1/async/jobs/{job_id}", headers=headers or auth()).json()


def test_replica_failure_is_retried_then_succeeds(replica, tmp_path):
    gateway = start(replica, tmp_path)
    replica.fail_status = 503
    try:
        with httpx.Client(base_url=gateway.url) as client:
            job_id = submit(client)
            wait_until(
                lambda: (job := job_of(client, job_id))["status"] == "queued" and job["attempts"] == 1,
                what="the failed first attempt to be re-queued",
            )
            requeued = job_of(client, job_id)
            assert (requeued["error"]["status"], requeued["error"]["code"]) == (502, "upstream_error")
            replica.fail_status = None
            wait_until(lambda: job_of(client, job_id)["status"] == "succeeded", what="the retry to succeed")
            job = job_of(client, job_id)
    finally:
        gateway.stop()
    assert (job["attempts"], job["status_code"], job["error"]) == (2, 200, None)
    assert job["result"]["choices"][0]["text"] == "Hello from r"


def test_attempts_are_bounded_and_client_errors_are_not_retried(replica, tmp_path):
    gateway = start(replica, tmp_path, max_attempts=2)
    try:
        with httpx.Client(base_url=gateway.url) as client:
            replica.fail_status = 503
            exhausted = submit(client)
            wait_until(
                lambda: job_of(client, exhausted)["status"] == "failed", timeout_s=30, what="giving up"
            )
            replica.fail_status = 400
            refused = submit(client)
            wait_until(lambda: job_of(client, refused)["status"] == "failed", what="the 400 to fail the job")
            exhausted, refused = job_of(client, exhausted), job_of(client, refused)
    finally:
        gateway.stop()
    assert (exhausted["attempts"], exhausted["status_code"], exhausted["error"]["code"]) == (
        2,
        502,
        "upstream_error",
    )
    assert (refused["attempts"], refused["status_code"]) == (1, 400)
    assert refused["result"] == {
        "error": {"message": "r fails", "type": "server_error", "param": None, "code": None}
    }
    assert refused["error"]["message"] == "r fails"


def test_revoked_key_stops_its_queued_jobs(replica, tmp_path):
    store_path = tmp_path / "keys.db"
    keys = KeyStore(store_path)
    key, record = keys.create("temp", KeyPolicy())
    gateway = start(replica, tmp_path, keys={"store": str(store_path)})
    replica.hold()
    headers = {"authorization": f"Bearer {key}"}
    try:
        with httpx.Client(base_url=gateway.url) as client:
            running = submit(client, headers)
            wait_until(lambda: replica.in_flight == 1, what="the first job to reach the replica")
            queued = submit(client, headers)
            keys.revoke(record.id)
            replica.release()
            # The key is gone, so its owner can no longer read the jobs: look in the job store.
            store = gateway.jobs.runtime.store
            ended = ("succeeded", "failed")
            wait_until(
                lambda: (
                    stored_job(gateway, store, running).status in ended
                    and stored_job(gateway, store, queued).status in ended
                ),
                what="both jobs to end",
            )
            assert client.get(f"/v1/async/jobs/{queued}", headers=headers).status_code == 401
            running_job, queued_job = stored_job(gateway, store, running), stored_job(gateway, store, queued)
    finally:
        gateway.stop()
        keys.close()
    assert running_job.status == "succeeded"
    assert (queued_job.status, queued_job.status_code, queued_job.error["message"]) == (
        "failed",
        401,
        "The API key that submitted this job was revoked.",
    )


def stored_job(gateway: ProtocolGateway, store, job_id: str):
    """Read a job on the gateway's own event loop (the store's executor belongs to it)."""
    return asyncio.run_coroutine_threadsafe(store.get_job(job_id), gateway.server.loop).result(timeout=10)


def test_job_interrupted_without_attempts_left_fails_with_reason_and_webhook(replica, tmp_path):
    # A gateway died while this job ran its last allowed attempt: leave the store exactly like that.
    with WebhookReceiver() as receiver:

        async def crashed_store() -> str:
            store = JobStore(tmp_path / "jobs.db")
            await store.open()
            job = await store.create_job(
                NewJob(
                    key_id="inline:alpha",
                    owner={"key_id": "inline:alpha", "name": "alpha", "policy": {}},
                    kind="async",
                    endpoint="/v1/completions",
                    body={"model": "tiny", "prompt": "p"},
                    priority=1,
                    max_time_in_queue_s=600,
                    webhook_url=receiver.url,
                )
            )
            await store.claim_next()
            await store.close()
            return job.id

        job_id = asyncio.run(crashed_store())
        gateway = start(replica, tmp_path, max_attempts=1)
        try:
            with httpx.Client(base_url=gateway.url) as client:
                wait_until(
                    lambda: job_of(client, job_id)["webhook"]["status"] == "delivered", what="the webhook"
                )
                job = job_of(client, job_id)
        finally:
            gateway.stop()
    assert (job["status"], job["attempts"], job["error"]["code"]) == ("failed", 1, "interrupted")
    assert "stopped while this job was running" in job["error"]["message"]
    assert [headers["webhook-id"] for headers, _ in receiver.deliveries] == [f"msg_{job_id}"]
    assert replica.requests == []  # it was not run again
