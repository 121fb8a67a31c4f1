"""The admin API, guarded by the admin key (`admin_key_sha256` in the config) or an API key scoped to
the `admin` endpoint:

    GET    /admin/keys[?include_revoked=true][&include_usage=true]
                                                list keys (never the keys themselves), with their usage
    POST   /admin/keys                          {name, models, endpoints, priority, rpm, ...} -> 201 with the key, shown once
    GET    /admin/keys/{id_or_name}
    DELETE /admin/keys/{id_or_name}             revoke
    GET    /admin/replicas                      health, load and ejection state of every replica
    POST   /admin/replicas                      {model, url, id, region, labels, capacity, deployment, api_key}: a
                                                new replica joins routing after its first successful probe
    DELETE /admin/replicas/{id}[?timeout_s=30]  leaves routing at once, answers once its requests finish

Besides the admin key, the control token `ember up` hands its gateway in EMBER_GATEWAY_CONTROL_TOKEN
is accepted: it is how the autoscaler registers the replicas it starts.

The same guard protects the admin routes defined elsewhere: the web console's /admin/console/* and
PUT /admin/autoscaler (ember.gateway.console.routes), and every key's async jobs and batches,
/admin/jobs and /admin/batches (ember.gateway.jobs.admin).
"""

from __future__ import annotations

import hmac
import os
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse
from pydantic import field_validator

from ember.gateway.config import CONTROL_TOKEN_ENV, KeyPolicy, ReplicaConfig
from ember.gateway.dispatch import Dispatcher
from ember.gateway.errors import GatewayError
from ember.gateway.keys import KeyStore, KeyStoreError, StoredKey, parse_bearer, require_endpoint
from ember.gateway.membership import join, leave, new_replica
from ember.gateway.replicas import Replica
from ember.gateway.shared.keys import SharedKeyStore


class NewKey(KeyPolicy):
    name: str

    @field_validator("name", "models")
    @classmethod
    def _storable_text(cls, value: str | list[str]) -> str | list[str]:
        """JSON may escape a lone surrogate ("\\ud800"), which SQLite and JSON output cannot encode."""
        for text in [value] if isinstance(value, str) else value:
            try:
                text.encode()
            except UnicodeEncodeError:
                raise ValueError("must be valid Unicode text (it holds a lone surrogate)") from None
        return value

    @field_validator("name")
    @classmethod
    def _named(cls, name: str) -> str:
        if not name.strip():
            raise ValueError("must not be empty or only spaces")
        return name


class ReplicaRegistration(ReplicaConfig):
    model: str
    deployment: str | None = None  # default: the model's first (an autoscaled model's only) deployment


def _replica_state_name(replica: Replica, draining: bool) -> str:
    if draining:
        return "draining"
    if replica.awaiting_first_probe:
        return "loading"
    return "ready" if replica.healthy else "ejected"


def replica_state(replica: Replica, draining: bool = False) -> dict[str, Any]:
    return {
        "id": replica.id,
        "url": replica.url,
        "model": replica.model,
        "deployment": replica.deployment,
        "version": replica.version,
        "region": replica.region,
        "state": _replica_state_name(replica, draining),
        "healthy": replica.healthy,
        "awaiting_first_probe": replica.awaiting_first_probe,
        "ejection_reason": replica.ejection_reason,
        "outstanding": replica.outstanding,
        "capacity": replica.capacity,
        "metrics": {
            "waiting": replica.metrics.waiting,
            "running": replica.metrics.running,
            "kv_usage": replica.metrics.kv_usage,
            "prefix_cache_hits": replica.metrics.prefix_cache_hits,
        },
    }


def require_admin(dispatcher: Dispatcher, authorization: str | None) -> None:
    """The admin API's guard (and /metrics' with `metrics.require_auth`): the admin key, the control token
    `ember up` hands its gateway, or an API key scoped to the `admin` endpoint; else a 401 or 403."""
    control_token = os.environ.get(CONTROL_TOKEN_ENV) or None
    if control_token is not None and hmac.compare_digest(parse_bearer(authorization) or "", control_token):
        return
    if dispatcher.keys.is_admin(authorization):
        return
    principal = dispatcher.keys.find(authorization)
    if principal is not None:
        require_endpoint(principal, "admin")
        return
    if dispatcher.config.admin_key_sha256 is None:
        raise GatewayError(
            403, "The admin API is disabled: set admin_key_sha256 in the gateway config.", "permission_error",
            "admin_disabled",
        )  # fmt: skip
    raise GatewayError(401, "This endpoint needs the admin key.", "invalid_request_error", "invalid_admin_key")


class EmbeddedKeyAdmin:
    """The SQLite key store behind the same awaitable calls as the shared (PostgreSQL) one."""

    def __init__(self, store: KeyStore):
        self.store = store

    async def list(self, include_revoked: bool) -> list[StoredKey]:
        return self.store.list(include_revoked)

    async def create(self, name: str, policy: KeyPolicy) -> tuple[str, StoredKey]:
        return self.store.create(name, policy)

    async def get(self, id_or_name: str) -> StoredKey:
        return self.store.get(id_or_name)

    async def revoke(self, id_or_name: str) -> StoredKey:
        return self.store.revoke(id_or_name)


def build_admin_router(dispatcher: Dispatcher) -> APIRouter:
    def admin_only(request: Request) -> None:
        require_admin(dispatcher, request.headers.get("authorization"))

    def store() -> SharedKeyStore | EmbeddedKeyAdmin:
        if dispatcher.shared_keys is not None:
            return dispatcher.shared_keys
        if dispatcher.store is None:
            raise GatewayError(
                400, "No key store is configured (keys.store in the gateway config).", code="no_key_store"
            )
        return EmbeddedKeyAdmin(dispatcher.store)

    router = APIRouter(prefix="/admin", dependencies=[Depends(admin_only)])

    @router.get("/keys")
    async def list_keys(include_revoked: bool = False, include_usage: bool = False) -> dict[str, Any]:
        data = []
        for key in await store().list(include_revoked):
            entry = key.to_dict()
            if include_usage:
                entry["usage"] = dispatcher.usage.snapshot(key.id)
            data.append(entry)
        return {"object": "list", "data": data}

    @router.post("/keys", status_code=201)
    async def create_key(new_key: NewKey) -> dict[str, Any]:
        policy = KeyPolicy(**new_key.model_dump(exclude={"name"}))
        try:
            key, record = await store().create(new_key.name, policy)
        except KeyStoreError as exc:
            raise GatewayError(409, str(exc), code="key_exists", param="name") from None
        return {"key": key, **record.to_dict()}

    @router.get("/keys/{id_or_name}")
    async def get_key(id_or_name: str) -> dict[str, Any]:
        try:
            return (await store().get(id_or_name)).to_dict()
        except KeyStoreError as exc:
            raise GatewayError(404, str(exc), code="key_not_found") from None

    @router.delete("/keys/{id_or_name}")
    async def revoke_key(id_or_name: str) -> dict[str, Any]:
        try:
            record = await store().revoke(id_or_name)
        except KeyStoreError as exc:
            raise GatewayError(404, str(exc), code="key_not_found") from None
        dispatcher.keys.invalidate()
        return record.to_dict()

    @router.get("/replicas")
    async def replicas() -> JSONResponse:
        data = [replica_state(replica) for replica in dispatcher.pool.all()]
        data += [replica_state(replica, draining=True) for replica in dispatcher.pool.draining()]
        return JSONResponse({"object": "list", "data": data})

    @router.post("/replicas", status_code=201)
    async def register_replica(registration: ReplicaRegistration) -> dict[str, Any]:
        model = dispatcher.config.models.get(registration.model)
        if model is None:
            raise GatewayError(404, f"The model `{registration.model}` does not exist.", code="model_not_found", param="model")
        deployment = next(
            (d for d in model.deployments if registration.deployment in (None, d.name)), None
        )
        if deployment is None:
            raise GatewayError(
                404, f"Model `{registration.model}` has no deployment {registration.deployment!r}.",
                code="deployment_not_found", param="deployment",
            )  # fmt: skip
        if dispatcher.pool.get(registration.replica_id) is not None:
            raise GatewayError(409, f"Replica {registration.replica_id!r} is already registered.", code="replica_exists", param="id")
        replica = new_replica(
            registration.model, deployment, replica_id=registration.replica_id, url=registration.url,
            region=registration.region, labels=dict(registration.labels), capacity=registration.capacity,
            api_key=registration.replica_api_key or deployment.replica_api_key,
        )  # fmt: skip
        await join(dispatcher, replica)
        return replica_state(replica)

    @router.delete("/replicas/{replica_id:path}")
    async def deregister_replica(replica_id: str, timeout_s: float = Query(default=30.0, ge=0)) -> dict[str, Any]:
        replica = await leave(dispatcher, replica_id, timeout_s)
        if replica is None:
            raise GatewayError(404, f"No replica {replica_id!r} is registered.", code="replica_not_found")
        return {**replica_state(replica), "state": "removed", "drained": replica.outstanding == 0}

    return router
