"""Per-key limits shared by every gateway (`state: {backend: shared}`): RPM/TPM token buckets, concurrency
slots and budget reservations live in Redis, and each operation is one Lua script, so two gateways
admitting at the same instant cannot both take the last token. The refusals and headers are the
embedded limiter's (ember.gateway.ratelimit), built by the same functions.

Per key (the `{key_id}` hash tag keeps one key's state in one Redis Cluster slot):
    <prefix>:limits:{<key_id>}:requests   hash {level, updated_ms}   RPM bucket
    <prefix>:limits:{<key_id>}:tokens     hash {level, updated_ms}   TPM bucket
    <prefix>:limits:{<key_id>}:leases     zset admission id -> lease expiry (ms)   concurrency slots
    <prefix>:limits:{<key_id>}:reserved   hash admission id -> estimated tokens    budget reservations
    <prefix>:limits:{<key_id>}:revoked    string, set by a revocation               refused at admission

A revoked key is refused by every gateway's next admission (the revoking gateway writes the marker after
the PostgreSQL commit), not only once each gateway has reloaded its keys (NOTIFY, milliseconds, or the
1 s reload); the marker outlives any reload by far and then expires.

Admissions and settlements made in one event-loop tick go to Redis as one pipelined round trip
(ember.gateway.shared.script_batch); each script still runs atomically on its own.

Clocks come from Redis (TIME), never from a gateway. A bucket's hash expires once it would be full
again, so an idle key costs nothing. A gateway that dies with requests in flight cannot settle them:
their slots and reservations lapse when their lease (`state.redis.lease_s`) expires.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from dataclasses import dataclass

import redis.asyncio as aioredis

from ember.gateway.keys import Principal, invalid_api_key
from ember.gateway.ratelimit import (
    BucketState,
    check_budget,
    concurrency_error,
    limit_headers,
    rate_error,
    too_large_error,
)
from ember.gateway.shared.connection import SharedState, state_unavailable
from ember.gateway.shared.script_batch import ScriptBatcher
from ember.gateway.usage import UsageLedger

logger = logging.getLogger(__name__)

# Shared by both scripts: a bucket's level refilled to `now` (nil when the key has no such limit).
_REFILL = """
local function refill(key, capacity, now)
  if capacity <= 0 then return nil end
  local state = redis.call('HMGET', key, 'level', 'updated_ms')
  local level = tonumber(state[1]) or capacity
  local updated = tonumber(state[2]) or now
  return math.min(capacity, level + (now - updated) * capacity / 60000)
end
local function store(key, capacity, level, now)
  redis.call('HSET', key, 'level', tostring(level), 'updated_ms', tostring(now))
  redis.call('PEXPIRE', key, math.ceil((capacity - level) * 60000 / capacity) + 1000)
end
local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# KEYS: requests bucket, tokens bucket, leases, reserved, revoked marker.
# ARGV: rpm, tpm, estimate, max_concurrent, budget (-1: none), used tokens, admission id, lease ms.
# Returns {verdict, requests level, tokens level, reserved, wait ms for requests, wait ms for tokens}; levels
# as strings ('' without that limit) since Lua numbers reach Redis replies truncated to integers.
_ADMIT = (
    _REFILL
    + """
if redis.call('EXISTS', KEYS[5]) == 1 then return {'revoked', '', '', 0, '0', '0'} end
local rpm, tpm, estimate = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local max_concurrent, budget, used = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local now = clock()
local expired = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)
if #expired > 0 then
  redis.call('ZREM', KEYS[3], unpack(expired))
  redis.call('HDEL', KEYS[4], unpack(expired))
end
local reserved = 0
for _, tokens in ipairs(redis.call('HVALS', KEYS[4])) do reserved = reserved + tonumber(tokens) end
local requests = refill(KEYS[1], rpm, now)
local tokens = refill(KEYS[2], tpm, now)
local function answer(verdict, request_wait, token_wait)
  return {verdict, tostring(requests or ''), tostring(tokens or ''), reserved,
          tostring(request_wait), tostring(token_wait)}
end
if budget >= 0 and (used >= budget or used + reserved + estimate > budget) then return answer('budget', 0, 0) end
if max_concurrent > 0 and redis.call('ZCARD', KEYS[3]) >= max_concurrent then
  return answer('concurrency', 0, 0)
end
local request_wait, token_wait = 0, 0
if requests and requests < 1 then request_wait = (1 - requests) * 60000 / rpm end
if tokens and tokens < estimate then token_wait = (estimate - tokens) * 60000 / tpm end
if tokens and estimate > tpm then return answer('too_large', 0, 0) end
if request_wait > 0 or token_wait > 0 then return answer('rate', request_wait, token_wait) end
if requests then requests = requests - 1; store(KEYS[1], rpm, requests, now) end
if tokens then tokens = tokens - estimate; store(KEYS[2], tpm, tokens, now) end
local lease_ms = tonumber(ARGV[8])
redis.call('ZADD', KEYS[3], now + lease_ms, ARGV[7])
redis.call('HSET', KEYS[4], ARGV[7], estimate)
redis.call('PEXPIRE', KEYS[3], lease_ms)
redis.call('PEXPIRE', KEYS[4], lease_ms)
return answer('ok', 0, 0)
"""
)

# KEYS: tokens bucket, leases, reserved. ARGV: admission id, tpm, correction (used - estimate; '' unknown).
_SETTLE = (
    _REFILL
    + """
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
local tpm = tonumber(ARGV[2])
if tpm > 0 and ARGV[3] ~= '' then
  local now = clock()
  store(KEYS[1], tpm, refill(KEYS[1], tpm, now) - tonumber(ARGV[3]), now)
end
return 1
"""
)

# KEYS: reserved, leases. The tokens reserved by live (unexpired) admissions.
_RESERVED = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local live = redis.call('ZRANGEBYSCORE', KEYS[2], now, '+inf')
local total = 0
for _, id in ipairs(live) do total = total + (tonumber(redis.call('HGET', KEYS[1], id)) or 0) end
return total
"""


# A revocation's mark outlives every gateway's key reload (KEYS_RELOAD_S) by far, PostgreSQL outages included.
REVOKED_MARKER_S = 3600


def limits_key(prefix: str, key_id: str, part: str) -> str:
    """The Redis key of one part of an API key's limit state."""
    return f"{prefix}:limits:{{{key_id}}}:{part}"


@dataclass(slots=True)
class SharedAdmission:
    """One admitted request's claim in Redis; `settle` it exactly once."""

    principal: Principal
    admission_id: str
    estimated_tokens: int
    headers: dict[str, str]  # the x-ratelimit-* state right after admission


class SharedRateLimiter:
    def __init__(self, state: SharedState, usage: UsageLedger):
        self.redis = state.redis
        self.prefix = state.key_prefix
        self.lease_ms = math.ceil(state.lease_s * 1000)
        self.usage = usage
        self._admit = self.redis.register_script(_ADMIT)
        self._settle = self.redis.register_script(_SETTLE)
        self._reserved = self.redis.register_script(_RESERVED)
        self._batch = ScriptBatcher(self.redis)  # admissions and settlements: one round trip per tick
        self._settling: set[asyncio.Future] = set()

    def _key(self, key_id: str, part: str) -> str:
        return limits_key(self.prefix, key_id, part)

    async def reserved_tokens(self, key_id: str) -> int:
        try:
            return int(
                await self._reserved(keys=[self._key(key_id, "reserved"), self._key(key_id, "leases")])
            )
        except aioredis.RedisError as exc:
            raise state_unavailable("Redis", exc) from None

    async def admit(self, principal: Principal, estimated_tokens: int) -> SharedAdmission:
        policy = principal.policy
        key_id = principal.key_id
        admission_id = uuid.uuid4().hex
        budget = -1 if policy.token_budget is None else policy.token_budget
        used = self.usage.total_tokens(key_id)  # read once: the script and the refusal must agree
        reply = self._batch.run(
            self._admit,
            [self._key(key_id, part) for part in ("requests", "tokens", "leases", "reserved", "revoked")],
            [
                policy.rpm or 0,
                policy.tpm or 0,
                estimated_tokens,
                policy.max_concurrent or 0,
                budget,
                used,
                admission_id,
                self.lease_ms,
            ],
        )
        try:
            verdict, requests, tokens, reserved, request_wait_ms, token_wait_ms = await asyncio.shield(reply)
        except aioredis.RedisError as exc:
            raise state_unavailable("Redis", exc) from None
        except asyncio.CancelledError:
            # The caller left (its client disconnected) while the script was on its way: if it admitted
            # the request, give the slot and reservation back now rather than after the lease.
            abandoned = SharedAdmission(principal, admission_id, estimated_tokens, {})
            reply.add_done_callback(lambda done: self._release_abandoned(done, abandoned))
            raise
        if verdict == "revoked":
            raise invalid_api_key()
        headers = limit_headers(_bucket(policy.rpm, requests), _bucket(policy.tpm, tokens))
        if verdict == "budget":
            check_budget(principal, used, int(reserved), estimated_tokens)  # raises: same figures
        elif verdict == "concurrency":
            raise concurrency_error(principal)
        elif verdict == "too_large":
            raise too_large_error(principal, estimated_tokens, headers)
        elif verdict == "rate":
            raise rate_error(principal, float(request_wait_ms) / 1000, float(token_wait_ms) / 1000, headers)
        return SharedAdmission(principal, admission_id, estimated_tokens, headers)

    def _release_abandoned(self, reply: asyncio.Future, admission: SharedAdmission) -> None:
        if not reply.cancelled() and reply.exception() is None and reply.result()[0] == "ok":
            self.settle(admission, None)  # as a request that ended without usage: its TPM charge stays

    def settle(self, admission: SharedAdmission, used_tokens: int | None) -> None:
        """Release the slot and reservation and correct the TPM charge, as the embedded limiter does. Sent
        with this tick's batch, since requests finish in synchronous callbacks; `drain` waits for it."""
        key_id = admission.principal.key_id
        correction = "" if used_tokens is None else used_tokens - admission.estimated_tokens
        settled = self._batch.run(
            self._settle,
            [self._key(key_id, part) for part in ("tokens", "leases", "reserved")],
            [admission.admission_id, admission.principal.policy.tpm or 0, correction],
        )
        self._settling.add(settled)
        settled.add_done_callback(lambda done: self._settled(done, admission))

    def _settled(self, done: asyncio.Future, admission: SharedAdmission) -> None:
        self._settling.discard(done)
        if not done.cancelled() and done.exception() is not None:
            # The lease expires instead: the slot and reservation come back after state.redis.lease_s.
            logger.warning(
                "could not settle admission %s of key %s in Redis: %s",
                admission.admission_id,
                admission.principal.key_id,
                done.exception(),
            )

    async def drain(self) -> None:
        """Wait for the settlements still being written (at shutdown)."""
        if self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)

    def admission_headers(self, admission: SharedAdmission) -> dict[str, str]:
        return dict(admission.headers)


def _bucket(capacity: int | None, level: str) -> BucketState | None:
    """A bucket's header state from the level the script returned."""
    if not capacity:
        return None
    value = float(level)
    return BucketState(capacity, value, (capacity - value) * 60 / capacity)
