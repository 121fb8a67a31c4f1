"""The SQLite job store: state transitions, queue order, crash recovery, expiry and retention."""

from __future__ import annotations

import time

import pytest

from ember.gateway.jobs.store import JobStore, NewJob

OWNER = {"key_id": "k1", "name": "one", "policy": {}}


def spec(priority: int = 1, max_queue_s: float = 600.0, **extra) -> NewJob:
    return NewJob(
        key_id="k1",
        owner=OWNER,
        kind="async",
        endpoint="/v1/completions",
        body={"model": "tiny", "prompt": "hi"},
        priority=priority,
        max_time_in_queue_s=max_queue_s,
        **extra,
    )


@pytest.fixture
async def store(tmp_path):
    store = JobStore(tmp_path / "jobs.db")
    await store.open()
    yield store
    await store.close()


async def test_claims_by_priority_then_arrival_and_finishes(store):
    low = await store.create_job(spec(priority=0))
    first = await store.create_job(spec(priority=1))
    second = await store.create_job(spec(priority=1))
    urgent = await store.create_job(spec(priority=2))  # higher first
    order = [(await store.claim_next()).id for _ in range(4)]
    assert order == [urgent.id, first.id, second.id, low.id]
    assert await store.claim_next() is None

    done = await store.finish_job(first.id, "succeeded", status_code=200, result={"ok": 1})
    assert (done.status, done.status_code, done.result, done.attempts) == ("succeeded", 200, {"ok": 1}, 1)
    # Finishing twice does nothing: the job is no longer running.
    assert await store.finish_job(first.id, "failed") is None
    assert (await store.get_job(first.id)).status == "succeeded"


async def test_cancel_wins_over_a_late_result(store):
    job = await store.create_job(spec())
    await store.claim_next()
    before = await store.cancel_job(job.id)
    assert before.status == "running"
    assert await store.finish_job(job.id, "succeeded", status_code=200, result={}) is None
    after = await store.get_job(job.id)
    assert (after.status, after.error["code"], after.result) == ("cancelled", "cancelled", None)


async def test_overdue_jobs_expire_and_webhooks_become_pending(store):
    job = await store.create_job(spec(max_queue_s=0.01, webhook_url="http://127.0.0.1:1/hook"))
    fresh = await store.create_job(spec())
    expired = await store.expire_overdue(now=time.time() + 1)
    assert [j.id for j in expired] == [job.id]
    stored = await store.get_job(job.id)
    assert (stored.status, stored.webhook_status, stored.error["code"]) == (
        "expired",
        "pending",
        "max_time_in_queue_exceeded",
    )
    assert (await store.get_job(fresh.id)).status == "queued"
    assert [j.id for j in await store.jobs_with_pending_webhooks()] == [job.id]


async def test_requeued_job_waits_for_run_after_and_keeps_attempts(store):
    job = await store.create_job(spec())
    await store.claim_next()
    assert await store.requeue_job(job.id, {"code": "overloaded"}, run_after=time.time() + 60)
    assert await store.claim_next() is None
    again = await store.claim_next(now=time.time() + 61)
    assert (again.id, again.attempts, again.error) == (job.id, 2, {"code": "overloaded"})


async def test_recovery_after_a_crash_requeues_or_fails(tmp_path):
    path = tmp_path / "jobs.db"
    store = JobStore(path)
    await store.open()
    retry = await store.create_job(spec())
    exhausted = await store.create_job(spec(webhook_url="http://127.0.0.1:1/hook"))
    waiting = await store.create_job(spec(priority=0))
    await store.claim_next()
    await store.claim_next()
    # The second job already used its attempts: simulate two earlier runs.
    for _ in range(2):
        await store.requeue_job(exhausted.id, None)
        await store.claim_next()
    await store.close()  # the process "dies" with two jobs running

    store = JobStore(path)
    await store.open()
    assert await store.recover_interrupted(max_attempts=3) == (1, 1)
    assert (await store.get_job(retry.id)).status == "queued"
    failed = await store.get_job(exhausted.id)
    assert (failed.status, failed.attempts, failed.error["code"], failed.webhook_status) == (
        "failed",
        3,
        "interrupted",
        "pending",
    )
    assert (await store.get_job(waiting.id)).status == "queued"
    assert await store.count_by_status() == {"queued": 2, "failed": 1}
    await store.close()


async def test_release_gives_back_the_attempt(store):
    job = await store.create_job(spec())
    await store.claim_next()
    assert await store.release_job(job.id)
    released = await store.get_job(job.id)
    assert (released.status, released.attempts) == ("queued", 0)


async def test_results_are_deleted_after_ttl(store):
    done = await store.create_job(spec())
    hooked = await store.create_job(spec(webhook_url="http://127.0.0.1:1/hook"))
    await store.claim_next()
    await store.claim_next()
    await store.finish_job(done.id, "succeeded", status_code=200, result={})
    await store.finish_job(hooked.id, "succeeded", status_code=200, result={})
    # The webhook is still pending: that job is kept until the delivery ends.
    assert await store.delete_expired_results(ttl_s=10, now=time.time() + 5) == 0
    assert await store.delete_expired_results(ttl_s=10, now=time.time() + 20) == 1
    assert await store.get_job(done.id) is None
    await store.record_webhook_attempt(hooked.id, 200, None, "delivered")
    assert await store.delete_expired_results(ttl_s=10, now=time.time() + 20) == 1
    assert await store.get_job(hooked.id) is None


async def test_meta_value_is_created_once(store):
    first = await store.meta_value("secret", lambda: "a")
    assert first == "a"
    assert await store.meta_value("secret", lambda: "b") == "a"


def test_async_config_paths_and_errors(tmp_path, monkeypatch):
    from ember.gateway.config import GatewayConfigError, parse_config

    models = {"m": {"deployments": [{"replicas": [{"url": "http://127.0.0.1:1"}]}]}}
    monkeypatch.chdir(tmp_path)
    default = parse_config({"models": models}, base_dir=tmp_path / "conf")
    assert default.async_.store_path(default.base_dir) == tmp_path / "ember-jobs.db"
    relative = parse_config({"models": models, "async": {"store": "j.db"}}, base_dir=tmp_path / "conf")
    assert relative.async_.store_path(relative.base_dir) == tmp_path / "conf" / "j.db"
    with pytest.raises(GatewayConfigError, match=r"async\.webhooks\.allow: .*'10\.0\.0\.0/33' is not a valid CIDR"):
        parse_config({"models": models, "async": {"webhooks": {"allow": ["10.0.0.0/33"]}}})
    with pytest.raises(GatewayConfigError, match=r"async\.jobs\.concurrency: Input should be greater than 0"):
        parse_config({"models": models, "async": {"jobs": {"concurrency": 0}}})
    with pytest.raises(GatewayConfigError, match=r"async\.grpc\.prot: Extra inputs are not permitted"):
        parse_config({"models": models, "async": {"grpc": {"prot": 1}}})


async def test_one_process_per_store_and_clear_open_errors(tmp_path):
    from ember.gateway.jobs.store import JobStoreError

    first = JobStore(tmp_path / "jobs.db")
    await first.open()
    second = JobStore(tmp_path / "jobs.db")
    with pytest.raises(JobStoreError, match="in use by another gateway process"):
        await second.open()
    await first.close()
    await second.open()  # free again once the first one closed (or its process died)
    await second.close()
    (tmp_path / "file").write_text("")
    with pytest.raises(JobStoreError, match="cannot open the job store"):
        await JobStore(tmp_path / "file" / "jobs.db").open()
