"""The admin API, guarded by the admin key (`admin_key_sha256` in the config) or an API key scoped to
the `admin` endpoint:

    GET    /admin/keys[?include_revoked=true]   list keys (never the keys themselves)
    POST   /admin/keys                          {name, models, endpoints, priority, rpm, ...} -> 201 with the key, shown once
    GET    /admin/keys/{id_or_name}
    DELETE /admin/keys/{id_or_name}             revoke
    GET    /admin/replicas                      health, load and ejection state of every replica
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from ember.gateway.config import KeyPolicy
from ember.gateway.dispatch import Dispatcher
from ember.gateway.errors import GatewayError
from ember.gateway.keys import KeyStore, KeyStoreError, require_endpoint


class NewKey(KeyPolicy):
    name: str


def require_admin(dispatcher: Dispatcher, authorization: str | None) -> None:
    """The admin API's guard (and /metrics' with `metrics.require_auth`): the admin key, or an API key
    scoped to the `admin` endpoint; else a 401 or 403."""
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


def build_admin_router(dispatcher: Dispatcher) -> APIRouter:
    def admin_only(request: Request) -> None:
        require_admin(dispatcher, request.headers.get("authorization"))

    def store() -> KeyStore:
        if dispatcher.store is None:
            raise GatewayError(
                400, "No key store is configured (keys.store in the gateway config).", code="no_key_store"
            )
        return dispatcher.store

    router = APIRouter(prefix="/admin", dependencies=[Depends(admin_only)])

    @router.get("/keys")
    async def list_keys(include_revoked: bool = False) -> dict[str, Any]:
        return {"object": "list", "data": [key.to_dict() for key in store().list(include_revoked)]}

    @router.post("/keys", status_code=201)
    async def create_key(new_key: NewKey) -> dict[str, Any]:
        policy = KeyPolicy(**new_key.model_dump(exclude={"name"}))
        try:
            key, record = store().create(new_key.name, policy)
        except KeyStoreError as exc:
            raise GatewayError(409, str(exc), code="key_exists", param="name") from None
        return {"key": key, **record.to_dict()}

    @router.get("/keys/{id_or_name}")
    async def get_key(id_or_name: str) -> dict[str, Any]:
        try:
            return store().get(id_or_name).to_dict()
        except KeyStoreError as exc:
            raise GatewayError(404, str(exc), code="key_not_found") from None

    @router.delete("/keys/{id_or_name}")
    async def revoke_key(id_or_name: str) -> dict[str, Any]:
        try:
            record = store().revoke(id_or_name)
        except KeyStoreError as exc:
            raise GatewayError(404, str(exc), code="key_not_found") from None
        dispatcher.keys.invalidate()
        return record.to_dict()

    @router.get("/replicas")
    async def replicas() -> JSONResponse:
        data = [
            {
                "id": replica.id,
                "url": replica.url,
                "model": replica.model,
                "deployment": replica.deployment,
                "version": replica.version,
                "region": replica.region,
                "healthy": replica.healthy,
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
            for replica in dispatcher.pool.all()
        ]
        return JSONResponse({"object": "list", "data": data})

    return router
