"""Webhook delivery for finished async jobs, following the Standard Webhooks spec.

Each delivery carries `webhook-id` (the same on every retry, so receivers can de-duplicate),
`webhook-timestamp` (unix seconds of this attempt) and `webhook-signature`
(`v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">`). Every API key gets its own secret, derived
from the gateway's master secret, so keys never see each other's signatures; a key reads its secret from
GET /v1/async/webhook-secret.

SSRF: the target host is resolved and refused when any address is private, loopback, link-local,
multicast or reserved, unless it or its address is allowlisted; the request then goes to the address
that was checked (Host header and TLS SNI keep the name), so DNS cannot be re-pointed in between.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import ipaddress
import json
import logging
import random
import secrets
import socket
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from urllib.parse import urlsplit, urlunsplit

import httpx

from ember.gateway.jobs.config import WebhooksConfig
from ember.gateway.jobs.metrics import JobMetrics
from ember.gateway.jobs.store import Job, JobStore
from ember.side_client import side_client

logger = logging.getLogger("ember.gateway.webhooks")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# Deliveries in flight at once; the rest wait their turn (a burst of finished jobs must not open
# thousands of connections).
MAX_CONCURRENT_DELIVERIES = 32
# How often pending deliveries no task holds are looked for (a shared store's dead gateways leave some).
RESUME_INTERVAL_S = 1.0


class WebhookURLError(ValueError):
    """The webhook URL is malformed or points somewhere the gateway refuses to call."""


def generate_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def secret_bytes(secret: str) -> bytes:
    return base64.b64decode(secret.removeprefix("whsec_"))


def derive_key_secret(master_secret: str, key_id: str) -> str:
    """The per-key signing secret: HMAC(master, key id), so it needs no storage of its own."""
    derived = hmac.new(
        secret_bytes(master_secret), b"ember-webhook:" + key_id.encode(), hashlib.sha256
    ).digest()
    return "whsec_" + base64.b64encode(derived).decode()


def sign(secret: str, webhook_id: str, timestamp: int, body: bytes) -> str:
    signed = f"{webhook_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret_bytes(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def verify(secret: str, headers: dict[str, str], body: bytes) -> bool:
    """Receiver side of the spec (used by tests and documented for clients)."""
    expected = sign(secret, headers["webhook-id"], int(headers["webhook-timestamp"]), body).split(",", 1)[1]
    for candidate in headers["webhook-signature"].split():
        version, _, signature = candidate.partition(",")
        if version == "v1" and hmac.compare_digest(signature, expected):
            return True
    return False


def webhook_id(job_id: str) -> str:
    return f"msg_{job_id}"


def webhook_body(job: Job) -> bytes:
    """The same bytes on every attempt: the job as GET shows it, minus the delivery record itself."""
    data = job.to_public()
    data.pop("webhook")
    finished = datetime.fromtimestamp(job.finished_at or job.created_at, UTC)
    payload = {"type": f"async_job.{job.status}", "timestamp": finished.isoformat(), "data": data}
    return json.dumps(payload, separators=(",", ":")).encode()


class TargetGuard:
    """Decides whether a webhook URL may be called, and to which checked address."""

    def __init__(self, allow: Iterable[str]) -> None:
        self.allowed_networks = []
        self.allowed_hosts = set()
        for entry in allow:
            if "/" in entry:
                self.allowed_networks.append(ipaddress.ip_network(entry, strict=False))
            else:
                try:
                    self.allowed_networks.append(ipaddress.ip_network(entry))
                except ValueError:
                    self.allowed_hosts.add(entry.lower())

    @staticmethod
    def parse(url: str) -> tuple[str, str, int]:
        """(scheme, host, port) of a well-formed http(s) URL, else WebhookURLError."""
        if not isinstance(url, str) or len(url) > 2048:
            raise WebhookURLError("webhook_url must be a string of at most 2048 characters")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise WebhookURLError("webhook_url must be an http:// or https:// URL")
        if not parts.hostname:
            raise WebhookURLError("webhook_url has no host")
        if parts.username or parts.password:
            raise WebhookURLError("webhook_url must not carry credentials")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise WebhookURLError("webhook_url has an invalid port") from None
        return parts.scheme, parts.hostname.lower(), port

    def _address_allowed(self, address: IPAddress) -> bool:
        if any(address in network for network in self.allowed_networks):
            return True
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            return self._address_allowed(address.ipv4_mapped)
        return address.is_global and not address.is_multicast

    async def resolve(self, url: str) -> IPAddress:
        """The address to connect to, after checking every address the host resolves to."""
        _, host, port = self.parse(url)
        try:
            addresses = [ipaddress.ip_address(host)]
        except ValueError:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as exc:
                raise WebhookURLError(f"webhook_url host {host!r} does not resolve: {exc}") from None
            addresses = list(dict.fromkeys(ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos))
        if host in self.allowed_hosts:
            return addresses[0]
        refused = [str(address) for address in addresses if not self._address_allowed(address)]
        if refused:
            raise WebhookURLError(
                f"webhook_url host {host!r} resolves to a private, loopback, link-local or reserved address "
                f"({', '.join(refused)}); allow it under async.webhooks.allow in the gateway config"
            )
        return addresses[0]


def pinned_request_target(url: str, address: IPAddress) -> tuple[str, str, dict[str, str]]:
    """(url with the host replaced by the checked address, Host header, request extensions)."""
    parts = urlsplit(url)
    literal = f"[{address}]" if address.version == 6 else str(address)
    netloc = literal if parts.port is None else f"{literal}:{parts.port}"
    host_header = parts.netloc.rsplit("@", 1)[-1]
    extensions = {"sni_hostname": parts.hostname} if parts.scheme == "https" else {}
    return urlunsplit(parts._replace(netloc=netloc)), host_header, extensions


class WebhookSender:
    """Delivers webhooks of finished jobs in the background, with bounded, jittered retries.

    State lives in the job store (`webhook_status` 'pending' until 'delivered' or 'failed'), so
    deliveries cut short by a restart resume with the same webhook-id and their attempts counted."""

    def __init__(self, store: JobStore, config: WebhooksConfig, metrics: JobMetrics | None = None) -> None:
        self.store = store
        self.config = config
        self.metrics = metrics or JobMetrics(None)
        self.guard = TargetGuard(config.allow)
        self.master_secret = config.signing_secret or ""
        self._client: httpx.AsyncClient | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._slots = asyncio.Semaphore(MAX_CONCURRENT_DELIVERIES)
        self._resumer: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if not self.master_secret:
            self.master_secret = await self.store.meta_value("webhook_master_secret", generate_secret)
        self._client = side_client(self.config.timeout_s)
        for job in await self.store.jobs_with_pending_webhooks():  # cut short by a restart
            self.submit(job)
        self._resumer = asyncio.create_task(self._resume_pending(), name="ember-webhook-resume")

    async def _resume_pending(self) -> None:
        """Every RESUME_INTERVAL_S, deliveries left pending that no task holds: with the shared job
        store, those of a gateway that died."""
        while True:
            await asyncio.sleep(RESUME_INTERVAL_S)
            try:
                for job in await self.store.jobs_with_pending_webhooks():
                    self.submit(job)
            except Exception:  # noqa: BLE001 - e.g. the store is briefly unreachable: try again later
                logger.exception("webhooks: could not read pending deliveries")

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        if self._resumer is not None:
            tasks.append(self._resumer)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._resumer = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def secret_for(self, key_id: str) -> str:
        return derive_key_secret(self.master_secret, key_id)

    def submit(self, job: Job) -> None:
        """Start delivering a finished job's webhook (no-op when it has none or one is underway)."""
        if job.webhook_url is None or job.id in self._tasks:
            return
        task = asyncio.create_task(self._deliver(job), name=f"webhook-{job.id}")
        self._tasks[job.id] = task
        task.add_done_callback(lambda _: self._tasks.pop(job.id, None))

    async def wait_idle(self) -> None:
        while self._tasks:
            await asyncio.gather(*list(self._tasks.values()), return_exceptions=True)

    def backoff_s(self, attempt: int) -> float:
        """Delay after the attempt-th failure: exponential, capped, with jitter in [delay/2, delay]."""
        delay = min(self.config.backoff_max_s, self.config.backoff_initial_s * 2 ** (attempt - 1))
        return random.uniform(delay / 2, delay)

    async def _deliver(self, job: Job) -> None:
        assert job.webhook_url is not None and self._client is not None
        body = webhook_body(job)
        message_id = webhook_id(job.id)
        secret = self.secret_for(job.key_id)
        attempt = await self.store.webhook_attempt_count(job.id)
        while attempt < self.config.max_attempts:
            attempt += 1
            async with self._slots:
                status_code, error = await self._post_once(job.webhook_url, message_id, secret, body)
            delivered = status_code is not None and 200 <= status_code < 300
            last = delivered or attempt >= self.config.max_attempts
            final = ("delivered" if delivered else "failed") if last else None
            await self.store.record_webhook_attempt(job.id, status_code, error, final)
            self.metrics.webhook_attempts.labels(final or "retry").inc()
            if last:
                if not delivered:
                    logger.warning("webhook for job %s failed after %d attempts: %s", job.id, attempt, error)
                return
            await asyncio.sleep(self.backoff_s(attempt))
        await self.store.record_webhook_attempt(job.id, None, "no attempts left", "failed")

    async def _post_once(
        self, url: str, message_id: str, secret: str, body: bytes
    ) -> tuple[int | None, str | None]:
        assert self._client is not None
        try:
            address = await self.guard.resolve(url)
        except WebhookURLError as exc:
            return None, str(exc)
        target, host_header, extensions = pinned_request_target(url, address)
        timestamp = int(time.time())
        headers = {
            "host": host_header,
            "content-type": "application/json",
            "user-agent": "ember-gateway-webhooks",
            "webhook-id": message_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(secret, message_id, timestamp, body),
        }
        try:
            response = await self._client.post(target, content=body, headers=headers, extensions=extensions)
        except httpx.TimeoutException:
            return None, f"timed out after {self.config.timeout_s:g} s"
        except httpx.HTTPError as exc:
            return None, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if 200 <= response.status_code < 300:
            return response.status_code, None
        return response.status_code, f"receiver answered HTTP {response.status_code}"
