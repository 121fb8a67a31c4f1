"""Per-key limits: token buckets for requests/min and tokens/min, max concurrent requests and the
lifetime token budget. Over a limit -> 429 with `Retry-After` and OpenAI's `x-ratelimit-*` headers.

Tokens are estimated at admission (ember.gateway.token_estimate: every prompt plus max_tokens for
every choice) and that estimate is reserved at once, against the TPM bucket and against the token
budget, so concurrent requests cannot all be admitted on the same unspent budget. When the request
completes, the reservation is settled from the replica's `usage`: the key pays for what it actually
used. A request that ends without usage (failed, client gone) releases its budget reservation
unspent; its TPM charge stays, so cutting streams short does not raise a key's rate.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ember.gateway.errors import GatewayError
from ember.gateway.keys import Principal
from ember.gateway.usage import UsageLedger


class TokenBucket:
    """Holds up to `capacity` tokens and refills `capacity` per `period_s`. The level may go below
    zero when a correction charges more than was estimated: that debt delays the next admission."""

    __slots__ = ("capacity", "rate", "level", "updated")

    def __init__(self, capacity: float, period_s: float = 60.0):
        self.capacity = capacity
        self.rate = capacity / period_s
        self.level = capacity
        self.updated = time.monotonic()

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until `amount` tokens are available (0 when they are now)."""
        self._refill(now)
        missing = amount - self.level
        return 0.0 if missing <= 0 else missing / self.rate

    def take(self, amount: float) -> None:
        self.level -= amount

    def reset_s(self, now: float) -> float:
        """Seconds until the bucket is full again."""
        self._refill(now)
        return (self.capacity - self.level) / self.rate


def format_duration(seconds: float) -> str:
    """OpenAI's reset format: '20ms', '1s', '6m0s'."""
    if seconds < 1:
        return f"{max(math.ceil(seconds * 1000), 0)}ms"
    minutes, rest = divmod(seconds, 60)
    rest_text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{rest_text}" if minutes else rest_text


class KeyLimits:
    __slots__ = ("requests", "tokens", "in_flight", "reserved_tokens")

    def __init__(self, principal: Principal):
        policy = principal.policy
        self.requests = TokenBucket(policy.rpm) if policy.rpm else None
        self.tokens = TokenBucket(policy.tpm) if policy.tpm else None
        self.in_flight = 0
        self.reserved_tokens = 0  # estimates of admitted requests not settled yet


@dataclass(slots=True)
class Admission:
    """One admitted request's claim on its key's limits; `settle` it exactly once."""

    principal: Principal
    limits: KeyLimits
    estimated_tokens: int


class RateLimiter:
    """The embedded limiter: buckets and counters in this process (`state: {backend: embedded}`).
    ember.gateway.shared.ratelimit.SharedRateLimiter keeps the same state in Redis for several gateways."""

    def __init__(self, usage: UsageLedger):
        self.usage = usage
        self._limits: dict[str, KeyLimits] = {}

    def _limits_for(self, principal: Principal) -> KeyLimits:
        limits = self._limits.get(principal.key_id)
        if limits is None:
            limits = self._limits[principal.key_id] = KeyLimits(principal)
        return limits

    async def reserved_tokens(self, key_id: str) -> int:
        """Tokens reserved by the key's admitted requests that have not completed yet."""
        limits = self._limits.get(key_id)
        return 0 if limits is None else limits.reserved_tokens

    async def admit(self, principal: Principal, estimated_tokens: int) -> Admission:
        policy = principal.policy
        limits = self._limits_for(principal)
        now = time.monotonic()
        if policy.token_budget is not None:
            check_budget(principal, self.usage.total_tokens(principal.key_id), limits.reserved_tokens, estimated_tokens)
        if policy.max_concurrent is not None and limits.in_flight >= policy.max_concurrent:
            raise concurrency_error(principal)
        request_wait = limits.requests.wait_for(1, now) if limits.requests else 0.0
        token_wait = limits.tokens.wait_for(estimated_tokens, now) if limits.tokens else 0.0
        if limits.tokens is not None and estimated_tokens > limits.tokens.capacity:
            raise too_large_error(principal, estimated_tokens, self.headers(limits, now))
        if request_wait > 0 or token_wait > 0:
            raise rate_error(principal, request_wait, token_wait, self.headers(limits, now))
        if limits.requests:
            limits.requests.take(1)
        if limits.tokens:
            limits.tokens.take(estimated_tokens)
        limits.in_flight += 1
        limits.reserved_tokens += estimated_tokens
        return Admission(principal, limits, estimated_tokens)

    def settle(self, admission: Admission, used_tokens: int | None) -> None:
        """Release the concurrency slot and the budget reservation, and replace the TPM estimate by
        what was used (None: unknown, e.g. the stream was cut short -> the TPM charge stays).
        Record the usage in the ledger before settling, so the budget never looks unpaid."""
        limits = admission.limits
        limits.in_flight -= 1
        limits.reserved_tokens -= admission.estimated_tokens
        if limits.tokens is not None and used_tokens is not None:
            limits.tokens.take(used_tokens - admission.estimated_tokens)

    def admission_headers(self, admission: Admission) -> dict[str, str]:
        """The `x-ratelimit-*` headers of an admitted request's response."""
        return self.headers(admission.limits)

    def headers(self, limits: KeyLimits, now: float | None = None) -> dict[str, str]:
        now = time.monotonic() if now is None else now
        requests, tokens = limits.requests, limits.tokens
        return limit_headers(
            None if requests is None else BucketState(requests.capacity, requests.level, requests.reset_s(now)),
            None if tokens is None else BucketState(tokens.capacity, tokens.level, tokens.reset_s(now)),
        )


# --- shared by the embedded and the shared (Redis) limiter: the same 429s and headers --------------


@dataclass(frozen=True, slots=True)
class BucketState:
    capacity: float
    level: float
    reset_s: float  # until the bucket is full again


def limit_headers(requests: BucketState | None, tokens: BucketState | None) -> dict[str, str]:
    headers: dict[str, str] = {}
    for name, bucket in (("requests", requests), ("tokens", tokens)):
        if bucket is not None:
            headers[f"x-ratelimit-limit-{name}"] = str(int(bucket.capacity))
            headers[f"x-ratelimit-remaining-{name}"] = str(max(int(bucket.level), 0))
            headers[f"x-ratelimit-reset-{name}"] = format_duration(bucket.reset_s)
    return headers


def check_budget(principal: Principal, used: int, reserved: int, estimated_tokens: int) -> None:
    """Refuse a request whose estimate does not fit what the budget has left once the requests
    in flight (`reserved`) are paid for: a burst then cannot spend more than the budget."""
    budget = principal.policy.token_budget
    if used >= budget:
        message = f"API key {principal.name!r} has used its token budget of {budget} tokens."
    elif used + reserved + estimated_tokens > budget:
        left = max(budget - used - reserved, 0)
        message = (
            f"Request needs up to about {estimated_tokens} tokens (prompts + max_tokens for each choice) but API "
            f"key {principal.name!r} has {left} of its token budget of {budget} tokens left "
            f"({reserved} reserved by requests in flight). Lower max_tokens or n, or send fewer prompts."
        )
    else:
        return
    raise GatewayError(429, message, "insufficient_quota", "insufficient_quota")


def concurrency_error(principal: Principal) -> GatewayError:
    return GatewayError(
        429,
        f"Too many concurrent requests for API key {principal.name!r}: limit {principal.policy.max_concurrent}.",
        "requests",
        "concurrency_limit_exceeded",
        headers={"retry-after": "1"},
    )


def too_large_error(principal: Principal, estimated_tokens: int, headers: dict[str, str]) -> GatewayError:
    return GatewayError(
        429,
        f"Request too large: about {estimated_tokens} tokens (prompt + max_tokens) but the key's limit "
        f"is {principal.policy.tpm} tokens per minute. Lower max_tokens or shorten the prompt.",
        "tokens",
        "rate_limit_exceeded",
        headers=headers,
    )


def rate_error(principal: Principal, request_wait: float, token_wait: float, headers: dict[str, str]) -> GatewayError:
    """The 429 of a key whose RPM or TPM bucket lacks what the request needs for `max(waits)` seconds."""
    policy = principal.policy
    wait = max(request_wait, token_wait)
    which, limit = ("requests", policy.rpm) if request_wait >= token_wait else ("tokens", policy.tpm)
    headers = {**headers, "retry-after": str(max(1, math.ceil(wait))), "retry-after-ms": str(math.ceil(wait * 1000))}
    return GatewayError(
        429,
        f"Rate limit reached for API key {principal.name!r} on {which} per min: limit {limit}. "
        f"Please try again in {format_duration(wait)}.",
        which,
        "rate_limit_exceeded",
        headers=headers,
    )
