"""The gateway's internal API, shared by every protocol (HTTP routes, WebSocket, gRPC, async jobs):

    principal = dispatcher.authenticate(authorization_header)        # GatewayError 401
    result = await dispatcher.dispatch(principal, "chat/completions", body, priority=..., ...)
    result.json()                       # non-streamed
    async for payload in result.events(): ...                         # streamed (`data` payloads)
    await result.aclose()

`dispatch` runs admission (model, key permissions, limits), waits in the priority queue while the
model's replicas are at capacity, asks the router for a replica, and fails over to another replica
while nothing has reached the caller yet. Every refusal is a `GatewayError`.
"""

from __future__ import annotations

import time

import orjson

from ember.gateway.admission_queue import AdmissionQueue
from ember.gateway.config import GatewayConfig, KeyEndpoint
from ember.gateway.errors import GatewayError, unavailable
from ember.gateway.health import HealthProber
from ember.gateway.http_client import UpstreamResponse
from ember.gateway.keys import KeyRing, KeyStore, Principal, require_endpoint
from ember.gateway.metrics import GatewayMetrics
from ember.gateway.priority import engine_priority, request_tier
from ember.gateway.proxy import (
    SSEParser,
    UpstreamClient,
    UpstreamFailure,
    UpstreamResult,
    read_body,
    read_first_events,
)
from ember.gateway.ratelimit import Admission, RateLimiter
from ember.gateway.replicas import Replica, ReplicaPool
from ember.gateway.request_body import RequestBody, parse_request_body
from ember.gateway.request_context import RequestContext
from ember.gateway.router import Router
from ember.gateway.scraper import MetricsScraper
from ember.gateway.shared.connection import SharedState
from ember.gateway.shared.keys import SharedKeyStore
from ember.gateway.shared.ratelimit import SharedAdmission, SharedRateLimiter
from ember.gateway.shared.usage import SharedUsageLedger
from ember.gateway.stalled_streams import StalledStreams
from ember.gateway.token_estimate import estimate_request_tokens
from ember.gateway.usage import UsageLedger

# The dispatcher's endpoints -> the key scope (KeyPolicy.endpoints) each one needs.
ENDPOINT_SCOPES: dict[str, KeyEndpoint] = {"chat/completions": "chat", "completions": "completions"}


class Dispatcher:
    """Owns the gateway's state (pool, keys, limits, queue, upstream client, probes); start/stop it
    inside the serving event loop."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.pool = ReplicaPool.from_config(config)
        self.metrics = GatewayMetrics(config.metrics.key_labels)
        self.metrics.watch_pool(self.pool)
        self.store = KeyStore(config.keys.store) if config.keys.store is not None else None
        # state: shared -> keys, usage and limits in PostgreSQL and Redis (opened in start()); embedded ->
        # the SQLite key store and this process's buckets.
        self.shared = SharedState(config.state) if config.state.shared else None
        self.shared_keys = SharedKeyStore(self.shared) if self.shared is not None else None
        self.keys = KeyRing(config, self.store, self.shared_keys)
        self.usage = (
            SharedUsageLedger(self.shared_keys) if self.shared_keys is not None else UsageLedger(self.store)
        )
        self.limiter: RateLimiter | SharedRateLimiter = (
            SharedRateLimiter(self.shared, self.usage) if self.shared is not None else RateLimiter(self.usage)
        )
        self.queue = AdmissionQueue(self.pool, config.queue.max_size, self.metrics)
        self.client = UpstreamClient(config.timeouts)
        self.health = HealthProber(self.pool, self.client, config.health)
        self.stalled = StalledStreams(self.pool, config.health)
        self.scraper = MetricsScraper(self.pool, self.client, config.scrape)
        self.router = Router(config, self.pool)

    async def start(self) -> None:
        if self.shared is not None:
            await self.shared.open()
            await self.shared_keys.start()
        await self.client.start()
        await self.usage.start()
        await self.health.start()
        await self.scraper.start()

    async def stop(self) -> None:
        await self.scraper.stop()
        await self.health.stop()
        await self.usage.stop()
        await self.client.close()
        if self.store is not None:
            self.store.close()
        if self.shared is not None:
            await self.shared_keys.stop()
            await self.limiter.drain()
            await self.shared.close()

    # --- the internal API --------------------------------------------------------------------

    def authenticate(self, authorization_header: str | None) -> Principal:
        return self.keys.authenticate(authorization_header)

    async def dispatch(
        self,
        principal: Principal,
        endpoint: str,
        body: dict,
        *,
        priority: int | None = None,
        deadline_s: float | None = None,
        client_region: str | None = None,
        session_id: str | None = None,
        is_background: bool = False,
        raw_body: bytes | None = None,
    ) -> UpstreamResult:
        """`raw_body`: the request's bytes when the caller has them, forwarded as-is when unchanged."""
        arrival = time.monotonic()
        if endpoint not in ENDPOINT_SCOPES:
            raise GatewayError(404, f"Unknown endpoint {endpoint!r}.", code="unknown_url")
        if not is_background:  # jobs were checked against the async or batch scope when submitted
            require_endpoint(principal, ENDPOINT_SCOPES[endpoint])
        request = parse_request_body(endpoint, body)
        model = request.model
        if model not in self.config.models:
            raise GatewayError(
                404, f"The model `{model}` does not exist.", code="model_not_found", param="model"
            )
        policy = principal.policy
        if not policy.allows_model(model):
            self.metrics.count_request(model, self.metrics.key_label(principal), "", "403")
            raise GatewayError(
                403, f"API key {principal.name!r} may not use model `{model}`.", "permission_error",
                "model_not_allowed", "model",
            )  # fmt: skip
        ctx = RequestContext(
            model=model,
            endpoint=endpoint,
            body=body,
            key_id=principal.key_id,
            priority=request_tier(policy, priority, is_background),
            client_region=client_region or self.config.listener_region,
            session_id=session_id or request.user,
            is_background=is_background,
        )
        if deadline_s is None:
            deadline_ms = policy.default_deadline_ms or self.config.queue.default_deadline_ms
            deadline_s = deadline_ms / 1000
        try:
            estimate = estimate_request_tokens(endpoint, body, self.config.limits.default_max_tokens)
            admission = await self.limiter.admit(principal, estimate)
        except GatewayError as exc:
            key = self.metrics.key_label(principal)
            if exc.status == 429:  # not a revoked key (401) or an unreachable shared state (503)
                self.metrics.rate_limited.labels(key, exc.type).inc()
            self.metrics.count_request(model, key, "", str(exc.status))
            raise
        try:
            return await self._forward(
                ctx, request, principal, admission, arrival, arrival + deadline_s, raw_body
            )
        except BaseException as exc:
            self.limiter.settle(admission, None)
            status = str(exc.status) if isinstance(exc, GatewayError) else "cancelled"
            self.metrics.count_request(model, self.metrics.key_label(principal), "", status)
            raise

    # --- internals -----------------------------------------------------------------------------

    def _select(self, ctx: RequestContext, exclude: set[str]) -> Replica | None:
        """A replica with a free slot now; None to wait in the queue (for capacity, on a first attempt for
        a replica's first successful probe, or, for an autoscaled model, for the replica the autoscaler
        starts); 503 when no replica can serve the request. A failover retry does not wait for replicas
        that have never answered: it reports the failure it met."""
        usable = [replica for replica in self.pool.replicas(ctx.model) if replica.id not in exclude]
        if not any(replica.healthy for replica in usable):
            if not exclude and any(replica.awaiting_first_probe for replica in usable):
                return None
            # An autoscaled model holds a first attempt in its queue while the autoscaler, which sees
            # the queue, starts a replica (activator); once one is admitted the queue wakes it.
            if self.config.models[ctx.model].autoscaling is None or exclude:
                raise unavailable(f"No healthy replica is available for model `{ctx.model}`.")
            return None
        replica = self.router.select(ctx.model, ctx, exclude)
        return replica if replica is not None and replica.has_capacity else None

    def holds_for_a_replica(self, model: object) -> bool:
        """Whether a request for `model` now would be held while a replica starts (scale from zero)."""
        config = self.config.models.get(model) if isinstance(model, str) else None
        return config is not None and config.autoscaling is not None and not self.pool.healthy(model)

    def _hold_limit(self, model: str) -> int | None:
        """How many requests an autoscaled model with no ready replica holds (None: the queue's limit)."""
        return self.config.models[model].autoscaling.hold_limit if self.holds_for_a_replica(model) else None

    def _upstream_body(
        self, ctx: RequestContext, replica: Replica, raw_body: bytes | None, force_usage: bool
    ) -> bytes:
        """The body for the replica: its model name, the engine priority of the request's tier in
        place of any the client sent, and usage for streams. The client's bytes go as they are when
        none of that changes them (tier 0 is the engine's default priority)."""
        body = ctx.body
        priority = engine_priority(ctx.priority)
        unchanged = (
            replica.upstream_model == ctx.model
            and not force_usage
            and "priority" not in body
            and priority == 0
        )
        if unchanged and raw_body is not None:
            return raw_body
        body = {**body, "model": replica.upstream_model, "priority": priority}
        if force_usage:
            # parse_request_body has checked that stream_options is an object or null.
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        return orjson.dumps(body)

    async def _forward(
        self,
        ctx: RequestContext,
        request: RequestBody,
        principal: Principal,
        admission: Admission | SharedAdmission,
        arrival: float,
        deadline: float,
        raw_body: bytes | None,
    ) -> UpstreamResult:
        stream = request.stream is True
        # Streams always ask the replica for usage (to correct the key's token count) and drop that
        # extra chunk when the client did not ask for it.
        force_usage = stream and not request.client_wants_usage
        routing_policy = self.config.models[ctx.model].routing.policy
        max_attempts = self.config.failover.max_attempts
        exclude: set[str] = set()
        last_failure: UpstreamFailure | None = None
        for attempt in range(max_attempts):
            ctx.attempt = attempt
            try:
                replica = await self.queue.acquire(
                    ctx.model,
                    ctx.priority,
                    deadline,
                    lambda: self._select(ctx, exclude),
                    self._hold_limit(ctx.model),
                )
            except GatewayError as exc:
                if last_failure is not None:
                    break  # no other replica to fail over to: report the replica's failure
                if exc.code == "deadline_exceeded" and not self.pool.healthy(ctx.model):
                    raise unavailable(
                        f"No healthy replica is available for model `{ctx.model}`: none became healthy "
                        "before the request's deadline."
                    ) from None
                raise
            route = ctx.extra.get("route")
            reason = route.reason if route is not None else ""
            self.metrics.routing_for(ctx.model, routing_policy, replica.id, reason).inc()
            response: UpstreamResponse | None = None
            try:
                response = await self.client.post(
                    replica, ctx.endpoint, self._upstream_body(ctx, replica, raw_body, force_usage)
                )
                if response.status >= 500:
                    body = await read_body(response)
                    raise UpstreamFailure(
                        f"http_{response.status}", f"HTTP {response.status}", False, response.status, body
                    )
                is_sse = response.headers.get("content-type", "").startswith("text/event-stream")
                if not stream or response.status != 200 or not is_sse:
                    body = await read_body(response)
                    result = UpstreamResult(
                        replica, response.status, self._headers(response, admission), body=body
                    )
                    self.pool.mark_success(replica)
                    self.metrics.observe_ttft(ctx.model, time.monotonic() - arrival)
                    self._finish(ctx, principal, admission, arrival, result, "ok", result.usage)
                    return result
                parser = SSEParser()
                first_events = await read_first_events(response, parser)
            except UpstreamFailure as failure:
                if response is not None:
                    response.close()
                self.pool.release(replica)
                self.pool.mark_failure(replica, failure.reason, eject_now=failure.eject_now)
                exclude.add(replica.id)
                last_failure = failure
                if attempt + 1 < max_attempts:
                    self.metrics.retries.labels(ctx.model, failure.reason).inc()
                continue
            except BaseException:
                if response is not None:
                    response.close()
                self.pool.release(replica)
                raise
            self.pool.mark_success(replica)
            first_token_s = time.monotonic() - arrival
            self.metrics.observe_ttft(ctx.model, first_token_s)
            streamed = UpstreamResult(
                replica,
                200,
                self._headers(response, admission),
                response=response,
                parser=parser,
                pending=first_events,
                strip_usage_chunk=force_usage,
                finisher=lambda result, outcome, usage, first_token_s=first_token_s: self._finish(
                    ctx, principal, admission, arrival, result, outcome, usage, first_token_s
                ),
            )
            self.stalled.watch(streamed)
            return streamed
        assert last_failure is not None
        tried = len(exclude)
        raise GatewayError(
            502,
            f"Model `{ctx.model}`: {tried} replica(s) failed before responding (last: {last_failure.detail}).",
            "server_error",
            "upstream_error",
        )

    def _headers(self, response: UpstreamResponse, admission: Admission | SharedAdmission) -> dict[str, str]:
        headers = self.limiter.admission_headers(admission)
        headers["content-type"] = response.headers.get("content-type", "application/json")
        return headers

    def _finish(
        self,
        ctx: RequestContext,
        principal: Principal,
        admission: Admission | SharedAdmission,
        arrival: float,
        result: UpstreamResult,
        outcome: str,
        usage: dict | None,
        first_token_s: float | None = None,
    ) -> None:
        """Once per dispatched request that reached a replica: free its slot, settle limits, account."""
        replica = result.replica
        if result.stream:
            self.stalled.forget(result)
        if result.stream and outcome == "error" and result.failure is not None:
            self.pool.mark_failure(replica, result.failure.reason, eject_now=result.failure.eject_now)
        self.pool.release(replica)
        key = self.metrics.key_label(principal)
        prompt = completion = 0
        if usage is not None:
            prompt = int(usage.get("prompt_tokens") or 0)
            completion = int(usage.get("completion_tokens") or 0)
            self.metrics.tokens_for(key, "prompt").inc(prompt)
            self.metrics.tokens_for(key, "completion").inc(completion)
        self.usage.record(principal.key_id, prompt, completion)
        self.limiter.settle(admission, None if usage is None else prompt + completion)
        status = str(result.status) if outcome == "ok" else f"stream_{outcome}"
        self.metrics.count_request(ctx.model, key, replica.id, status)
        self.metrics.observe_completion(ctx.model, time.monotonic() - arrival, completion, first_token_s)
