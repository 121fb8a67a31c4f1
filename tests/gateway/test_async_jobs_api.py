"""Async jobs over HTTP through the real gateway: a real `ember serve` replica for the happy path and
signed webhooks, a scripted Starlette upstream where a test must hold requests (cancel, expiry)."""

from __future__ import annotations

import time

import httpx
import pytest
from gateway_harness import wait_until
from protocols_support import (
    OTHER_KEY,
    ProtocolGateway,
    WebhookReceiver,
    auth,
    protocol_config,
    real_replica,  # noqa: F401 - fixture
)

from ember.gateway.jobs.webhooks import verify

TERMINAL = ("succeeded", "failed", "expired", "cancelled")


def wait_for_job(client: httpx.Client, job_id: str, statuses=TERMINAL) -> dict:
    job: dict = {}

    def reached() -> bool:
        nonlocal job
        job = client.get(f"/v1/async/jobs/{job_id}", headers=auth()).json()
        return job["status"] in statuses

    wait_until(reached, timeout_s=60, what=f"job {job_id} to reach {statuses}")
    return job


@pytest.fixture
def gateway(real_replica, tmp_path):  # noqa: F811
    gateway = ProtocolGateway(protocol_config([real_replica]), tmp_path).start()
    yield gateway
    gateway.stop()


def test_async_chat_job_succeeds_and_webhook_is_retried_until_delivered(gateway):
    with WebhookReceiver([500, 502, 200]) as receiver, httpx.Client(base_url=gateway.url) as client:
        response = client.post(
            "/v1/async/chat/completions",
            headers=auth(),
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "Say hi"}],
                "max_tokens": 4,
                "temperature": 0,
                "webhook_url": receiver.url,
                "priority": 0,
            },
        )
        assert response.status_code == 202, response.text
        accepted = response.json()
        assert accepted["status"] == "queued" and accepted["id"].startswith("job_")
        job = wait_for_job(client, accepted["id"])
        assert job["status"] == "succeeded", job
        assert job["status_code"] == 200 and job["attempts"] == 1 and job["priority"] == 0
        completion = job["result"]
        assert completion["object"] == "chat.completion"
        assert completion["usage"]["completion_tokens"] == 4
        assert completion["choices"][0]["finish_reason"] == "length"

        wait_until(
            lambda: (
                client.get(f"/v1/async/jobs/{job['id']}", headers=auth()).json()["webhook"]["status"]
                == "delivered"
            ),
            timeout_s=30,
            what="webhook delivery",
        )
        job = client.get(f"/v1/async/jobs/{job['id']}", headers=auth()).json()
        secret = client.get("/v1/async/webhook-secret", headers=auth()).json()["secret"]

    assert [(a["attempt"], a["status_code"]) for a in job["webhook"]["attempts"]] == [
        (1, 500),
        (2, 502),
        (3, 200),
    ]
    assert len(receiver.deliveries) == 3
    assert {headers["webhook-id"] for headers, _ in receiver.deliveries} == {f"msg_{job['id']}"}
    assert all(verify(secret, headers, body) for headers, body in receiver.deliveries)
    assert gateway.metric("ember_gateway_jobs_submitted_total", kind="async") == 1
    assert gateway.metric("ember_gateway_jobs_finished_total", kind="async", status="succeeded") == 1
    assert gateway.metric("ember_gateway_webhook_attempts_total", outcome="retry") == 2
    assert gateway.metric("ember_gateway_webhook_attempts_total", outcome="delivered") == 1
    metrics_text = httpx.get(gateway.url + "/metrics").text
    assert 'ember_gateway_jobs_finished_total{kind="async",status="succeeded"} 1.0' in metrics_text
    payload = httpx.Response(200, content=receiver.deliveries[-1][1]).json()
    assert payload["type"] == "async_job.succeeded"
    assert payload["data"]["result"] == completion


def test_jobs_are_private_to_their_key_and_inputs_are_validated(gateway):
    with httpx.Client(base_url=gateway.url) as client:
        job = client.post(
            "/v1/async/completions", headers=auth(), json={"model": "tiny", "prompt": "a", "max_tokens": 2}
        ).json()
        assert client.get(f"/v1/async/jobs/{job['id']}", headers=auth(OTHER_KEY)).status_code == 404
        assert client.delete(f"/v1/async/jobs/{job['id']}", headers=auth(OTHER_KEY)).status_code == 404
        assert client.get(f"/v1/async/jobs/{job['id']}").json()["error"]["code"] == "missing_api_key"
        assert client.get("/v1/async/jobs/job_unknown", headers=auth()).json()["error"]["code"] == "not_found"
        finished = wait_for_job(client, job["id"])
        assert finished["status"] == "succeeded"
        assert finished["result"]["object"] == "text_completion"
        # A finished job cannot be cancelled.
        conflict = client.delete(f"/v1/async/jobs/{job['id']}", headers=auth())
        assert (conflict.status_code, conflict.json()["error"]["code"]) == (409, "job_not_cancellable")

        cases = [
            ({"model": "tiny", "prompt": "a", "priority": 3}, 400, "priority"),
            ({"model": "tiny", "prompt": "a", "priority": True}, 400, "priority"),
            (
                {"model": "tiny", "prompt": "a", "max_time_in_queue_seconds": 0},
                400,
                "max_time_in_queue_seconds",
            ),
            ({"model": "tiny", "prompt": "a", "stream": True}, 400, "stream"),
            ({"model": "tiny", "prompt": "a", "webhook_url": "http://10.0.0.1/x"}, 400, "webhook_url"),
            ({"model": "tiny", "prompt": "a", "webhook_url": "ftp://example.com/x"}, 400, "webhook_url"),
            ({"prompt": "a"}, 400, "model"),
            ({"model": "nope", "prompt": "a"}, 404, "model"),
            ({"model": "tiny"}, 400, "prompt"),
        ]
        for body, status, param in cases:
            response = client.post("/v1/async/completions", headers=auth(), json=body)
            assert (response.status_code, response.json()["error"]["param"]) == (status, param), body
        malformed = client.post("/v1/async/chat/completions", headers=auth(), content=b"{not json")
        assert malformed.status_code == 400 and "not valid JSON" in malformed.json()["error"]["message"]
        refused = client.post(
            "/v1/async/completions",
            headers=auth(),
            json={"model": "tiny", "prompt": "a", "webhook_url": "http://169.254.169.254/latest"},
        ).json()["error"]
        assert refused["code"] == "invalid_webhook_url" and "link-local" in refused["message"]


def test_cancel_running_and_queued_jobs_and_expiry(held_gateway):
    gateway, replica = held_gateway
    replica.hold()
    with WebhookReceiver() as receiver, httpx.Client(base_url=gateway.url) as client:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "webhook_url": receiver.url}
        running = client.post("/v1/async/chat/completions", headers=auth(), json=body).json()
        wait_for_job(client, running["id"], statuses=("running",))
        queued = client.post("/v1/async/chat/completions", headers=auth(), json=body).json()
        expiring = client.post(
            "/v1/async/chat/completions", headers=auth(), json={**body, "max_time_in_queue_seconds": 0.3}
        ).json()
        assert client.get(f"/v1/async/jobs/{queued['id']}", headers=auth()).json()["status"] == "queued"

        expired = wait_for_job(client, expiring["id"])
        assert (expired["status"], expired["error"]["code"]) == ("expired", "max_time_in_queue_exceeded")

        cancelled = client.delete(f"/v1/async/jobs/{queued['id']}", headers=auth()).json()
        assert (cancelled["status"], cancelled["started_at"]) == ("cancelled", None)
        cancelled = client.delete(f"/v1/async/jobs/{running['id']}", headers=auth()).json()
        assert cancelled["status"] == "cancelled" and cancelled["result"] is None
        # The replica now answers the aborted request; the worker must not record it.
        replica.release()
        time.sleep(0.3)  # give a (wrong) late result or webhook time to arrive before checking none did
        assert client.get(f"/v1/async/jobs/{running['id']}", headers=auth()).json()["status"] == "cancelled"
        wait_until(lambda: len(receiver.deliveries) >= 1, what="the expiry webhook")
    # Only the expired job sends a webhook: cancellations were asked for by the client.
    assert [h["webhook-id"] for h, _ in receiver.deliveries] == [f"msg_{expiring['id']}"]
    assert b'"type":"async_job.expired"' in receiver.deliveries[0][1]
