"""The admin's view of async jobs and batches (/admin/jobs, /admin/jobs/{id}, /admin/batches), which
the console's Jobs and batches section reads: every key's jobs newest first, filtered by status and
kind, paginated, a job's webhook deliveries, batches with their progress; admin key only. On both job
stores: SQLite and PostgreSQL (state.backend shared)."""

from __future__ import annotations

import httpx
import pytest
from gateway_harness import FakeReplica, sha256, wait_until
from protocols_support import (
    KEY,
    OTHER_KEY,
    ProtocolGateway,
    WebhookReceiver,
    auth,
    create_chat_batch,
    protocol_config,
)

ADMIN = {"authorization": "Bearer sk-admin"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(params=["sqlite", "postgres"])
def gateway(request, tmp_path):
    replica = FakeReplica("r").start()
    extra = {"admin_key_sha256": sha256("sk-admin")}
    if request.param == "postgres":
        extra["state"] = request.getfixturevalue("shared_state")
    gateway = ProtocolGateway(protocol_config([replica.url], **extra), tmp_path).start()
    yield gateway
    gateway.stop()
    replica.stop()


def admin_get(gateway: ProtocolGateway, path: str, **params) -> httpx.Response:
    return httpx.get(gateway.url + path, params=params, headers=ADMIN, timeout=10)


def submit(gateway: ProtocolGateway, key: str, **extra) -> str:
    response = httpx.post(
        gateway.url + "/v1/async/chat/completions", json={**CHAT, **extra}, headers=auth(key)
    )
    assert response.status_code == 202, response.text
    return response.json()["id"]


def test_admin_lists_every_keys_jobs_and_batches_with_progress_and_webhooks(gateway):
    with WebhookReceiver([500, 200]) as receiver:
        first = submit(gateway, KEY, webhook_url=receiver.url)
        second = submit(gateway, OTHER_KEY)
        third = submit(gateway, KEY)
        batch_alpha = create_chat_batch(gateway.url, KEY, ["a", "b"])
        batch_beta = create_chat_batch(gateway.url, OTHER_KEY, ["c"])

        def all_done() -> bool:
            jobs = admin_get(gateway, "/admin/jobs", status="succeeded").json()["data"]
            delivered = admin_get(gateway, f"/admin/jobs/{first}").json()["webhook"]["status"] == "delivered"
            return len(jobs) == 6 and delivered

        wait_until(all_done, timeout_s=30, what="the jobs to succeed and the webhook to be delivered")

    async_jobs = admin_get(gateway, "/admin/jobs", kind="async").json()
    assert [(job["id"], job["key"], job["status"]) for job in async_jobs["data"]] == [
        (third, "alpha", "succeeded"), (second, "beta", "succeeded"), (first, "alpha", "succeeded"),
    ]  # fmt: skip
    assert async_jobs["has_more"] is False
    assert async_jobs["counts_by_status"] == {"succeeded": 6}  # every job, the batches' too
    assert "result" not in async_jobs["data"][0]
    assert async_jobs["data"][2]["webhook"] == {"url": receiver.url, "status": "delivered"}

    batch_jobs = admin_get(gateway, "/admin/jobs", kind="batch").json()["data"]
    assert sorted((job["custom_id"], job["batch_id"]) for job in batch_jobs) == [
        ("a", batch_alpha), ("b", batch_alpha), ("c", batch_beta),
    ]  # fmt: skip

    # Pages of two, newest first, over all six jobs.
    page = admin_get(gateway, "/admin/jobs", limit="2").json()
    seen = [job["id"] for job in page["data"]]
    while page["has_more"]:
        page = admin_get(gateway, "/admin/jobs", limit="2", after=page["last_id"]).json()
        seen += [job["id"] for job in page["data"]]
    assert len(seen) == 6 and len(set(seen)) == 6 and seen[-1] == first
    assert admin_get(gateway, "/admin/jobs", status="queued").json()["data"] == []

    job = admin_get(gateway, f"/admin/jobs/{first}").json()
    assert job["result"]["choices"][0]["message"]["content"] == "Hello from r"
    assert [(a["attempt"], a["status_code"]) for a in job["webhook"]["attempts"]] == [(1, 500), (2, 200)]

    batches = admin_get(gateway, "/admin/batches").json()["data"]
    assert [(b["id"], b["status"], b["request_counts"]) for b in batches] == [
        (batch_beta, "completed", {"total": 1, "completed": 1, "failed": 0}),
        (batch_alpha, "completed", {"total": 2, "completed": 2, "failed": 0}),
    ]
    newest_only = admin_get(gateway, "/admin/batches", limit="1").json()
    assert [b["id"] for b in newest_only["data"]] == [batch_beta] and newest_only["has_more"] is True
    after = admin_get(gateway, "/admin/batches", after=batch_beta).json()["data"]
    assert [b["id"] for b in after] == [batch_alpha]


@pytest.mark.parametrize(
    ("path", "params", "status", "param"),
    [
        ("/admin/jobs", {"status": "done"}, 400, "status"),
        ("/admin/jobs", {"kind": "sync"}, 400, "kind"),
        ("/admin/jobs", {"limit": "0"}, 400, "limit"),
        ("/admin/batches", {"limit": "101"}, 400, "limit"),
        ("/admin/jobs/job_nope", {}, 404, "id"),
    ],
)
def test_bad_queries_get_openai_errors(gateway, path, params, status, param):
    response = admin_get(gateway, path, **params)
    assert response.status_code == status
    assert response.json()["error"]["param"] == param


def test_jobs_and_batches_need_the_admin_key(gateway):
    job = submit(gateway, KEY)
    for path in ("/admin/jobs", f"/admin/jobs/{job}", "/admin/batches"):
        assert httpx.get(gateway.url + path).status_code == 401
        refused = httpx.get(gateway.url + path, headers=auth(KEY))
        assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error"
