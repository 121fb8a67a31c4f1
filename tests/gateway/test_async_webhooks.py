"""Webhook signing (Standard Webhooks), the SSRF guard, and delivery with retries to a real receiver."""

from __future__ import annotations

import ipaddress
import json

import pytest
from protocols_support import WebhookReceiver

from ember.gateway.jobs.config import WebhooksConfig
from ember.gateway.jobs.store import JobStore, NewJob
from ember.gateway.jobs.webhooks import (
    TargetGuard,
    WebhookSender,
    WebhookURLError,
    derive_key_secret,
    pinned_request_target,
    sign,
    verify,
)


def test_signature_matches_the_standard_webhooks_test_vector():
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    body = b'{"test": 2432232314}'
    signature = sign(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body)
    assert signature == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    headers = {"webhook-id": "msg_p5jXN8AQM9LWM0D4loKWxJek", "webhook-timestamp": "1614265330"}
    assert verify(secret, {**headers, "webhook-signature": f"v1,bogus {signature}"}, body)
    assert not verify(secret, {**headers, "webhook-signature": signature}, body + b" ")


def test_per_key_secrets_differ_and_are_stable():
    master = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    assert derive_key_secret(master, "a") == derive_key_secret(master, "a")
    assert derive_key_secret(master, "a") != derive_key_secret(master, "b")
    assert derive_key_secret(master, "a").startswith("whsec_")


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/hook",
        "http://localhost:8080/hook",
        "http://10.1.2.3/hook",
        "http://192.168.0.7/hook",
        "http://172.16.5.5/hook",
        "http://169.254.169.254/latest/meta-data",
        "http://[::1]/hook",
        "http://[::ffff:127.0.0.1]/hook",
        "http://[fe80::1]/hook",
        "http://0.0.0.0/hook",
        "http://100.64.0.1/hook",
        "https://224.0.0.1/hook",
    ],
)
async def test_guard_refuses_private_targets(url):
    with pytest.raises(WebhookURLError, match="private, loopback, link-local or reserved"):
        await TargetGuard([]).resolve(url)


@pytest.mark.parametrize(
    "url, message",
    [
        ("ftp://example.com/x", "http:// or https://"),
        ("http:///nohost", "no host"),
        ("http://user:pw@example.com/", "credentials"),
        ("http://example.com:99999/", "invalid port"),
        ("http://no-such-host.invalid/", "does not resolve"),
    ],
)
async def test_guard_rejects_malformed_urls(url, message):
    with pytest.raises(WebhookURLError, match=message):
        await TargetGuard([]).resolve(url)


async def test_guard_allowlist_by_cidr_and_host():
    assert await TargetGuard(["127.0.0.0/8"]).resolve("http://127.0.0.1:9/x") == ipaddress.ip_address(
        "127.0.0.1"
    )
    assert await TargetGuard(["10.0.0.5"]).resolve("http://10.0.0.5/x") == ipaddress.ip_address("10.0.0.5")
    assert await TargetGuard(["localhost"]).resolve("http://localhost/x") in (
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    )
    with pytest.raises(WebhookURLError):
        await TargetGuard(["127.0.0.0/8"]).resolve("http://10.0.0.5/x")
    assert await TargetGuard([]).resolve("https://93.184.216.34/x") == ipaddress.ip_address("93.184.216.34")


def test_pinned_target_keeps_host_header_and_sni():
    url, host, extensions = pinned_request_target(
        "https://hooks.example.com:8443/a?b=1", ipaddress.ip_address("93.184.216.34")
    )
    assert (url, host, extensions) == (
        "https://93.184.216.34:8443/a?b=1",
        "hooks.example.com:8443",
        {"sni_hostname": "hooks.example.com"},
    )
    url, host, extensions = pinned_request_target("http://h.example/x", ipaddress.ip_address("2001:db8::1"))
    assert (url, host, extensions) == ("http://[2001:db8::1]/x", "h.example", {})


async def finished_job(store: JobStore, url: str):
    job = await store.create_job(
        NewJob(
            key_id="key-7",
            owner={"key_id": "key-7", "name": "seven", "policy": {}},
            kind="async",
            endpoint="/v1/completions",
            body={"model": "tiny", "prompt": "hi"},
            priority=1,
            max_time_in_queue_s=600,
            webhook_url=url,
        )
    )
    await store.claim_next()
    return await store.finish_job(job.id, "succeeded", status_code=200, result={"choices": [{"text": "ok"}]})


@pytest.fixture
async def store(tmp_path):
    store = JobStore(tmp_path / "jobs.db")
    await store.open()
    yield store
    await store.close()


def config(**overrides) -> WebhooksConfig:
    return WebhooksConfig(
        **{
            "allow": ["127.0.0.0/8"],
            "backoff_initial_s": 0.01,
            "backoff_max_s": 0.05,
            "timeout_s": 2,
            **overrides,
        }
    )


async def test_fails_twice_then_delivered_with_one_webhook_id(store):
    with WebhookReceiver([500, 503, 200]) as receiver:
        sender = WebhookSender(store, config())
        await sender.start()
        job = await finished_job(store, receiver.url)
        sender.submit(job)
        await sender.wait_idle()
        await sender.stop()
    secret = sender.secret_for("key-7")
    assert len(receiver.deliveries) == 3
    assert {headers["webhook-id"] for headers, _ in receiver.deliveries} == {f"msg_{job.id}"}
    assert all(verify(secret, headers, body) for headers, body in receiver.deliveries)
    assert not verify(sender.secret_for("another-key"), *receiver.deliveries[0])
    assert len({body for _, body in receiver.deliveries}) == 1
    payload = json.loads(receiver.deliveries[0][1])
    assert payload["type"] == "async_job.succeeded"
    assert (payload["data"]["id"], payload["data"]["result"]) == (job.id, {"choices": [{"text": "ok"}]})
    stored = await store.get_job(job.id)
    assert stored.webhook_status == "delivered"
    assert [(a.attempt, a.status_code) for a in stored.webhook_attempts] == [(1, 500), (2, 503), (3, 200)]
    assert stored.webhook_attempts[0].error == "receiver answered HTTP 500"


async def test_gives_up_after_max_attempts(store):
    with WebhookReceiver([500] * 5) as receiver:
        sender = WebhookSender(store, config(max_attempts=2))
        await sender.start()
        job = await finished_job(store, receiver.url)
        sender.submit(job)
        await sender.wait_idle()
        await sender.stop()
    stored = await store.get_job(job.id)
    assert (stored.webhook_status, len(stored.webhook_attempts), len(receiver.deliveries)) == ("failed", 2, 2)


async def test_timeout_is_an_attempt_and_is_retried(store):
    with WebhookReceiver([200, 200], delay_s=0.6) as receiver:
        sender = WebhookSender(store, config(timeout_s=0.2, max_attempts=2))
        await sender.start()
        job = await finished_job(store, receiver.url)
        sender.submit(job)
        await sender.wait_idle()
        await sender.stop()
    stored = await store.get_job(job.id)
    assert stored.webhook_status == "failed"
    assert [a.error for a in stored.webhook_attempts] == ["timed out after 0.2 s"] * 2


async def test_pending_deliveries_resume_on_start_with_the_same_id(store):
    with WebhookReceiver([500, 200]) as receiver:
        job = await finished_job(store, receiver.url)
        await store.record_webhook_attempt(job.id, 500, "receiver answered HTTP 500", None)
        sender = WebhookSender(store, config())
        await sender.start()  # picks up the pending delivery by itself
        await sender.wait_idle()
        await sender.stop()
    stored = await store.get_job(job.id)
    assert [a.attempt for a in stored.webhook_attempts] == [1, 2, 3]
    assert stored.webhook_status == "delivered"
    assert [headers["webhook-id"] for headers, _ in receiver.deliveries] == [f"msg_{job.id}"] * 2


async def test_refused_target_is_recorded_not_called(store):
    sender = WebhookSender(store, config(allow=[], max_attempts=1))
    await sender.start()
    job = await finished_job(store, "http://127.0.0.1:9/hook")
    sender.submit(job)
    await sender.wait_idle()
    await sender.stop()
    stored = await store.get_job(job.id)
    assert stored.webhook_status == "failed"
    assert "loopback" in stored.webhook_attempts[0].error
