"""The admin API, guarded by the admin key (`admin_key_sha256` in the config):

    GET    /admin/keys[?include_revoked=true]   list keys (never the keys themselves)
    POST   /admin/keys                          {name, models, priority, rpm, ...} -> 201 with the key, shown once
    GET    /admin/keys/{id_or_name}
    DELETE /admin/keys/{id_or_name}             revoke
    GET    /admin/replicas                      health, load and ejection state of every replica
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import field_validator

from ember.gateway.config import KeyPolicy
from ember.gateway.dispatch import Dispatcher
from ember.gateway.errors import GatewayError
from ember.gateway.keys import KeyStore, KeyStoreError


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


def build_admin_router(dispatcher: Dispatcher) -> APIRouter:
    def require_admin(request: Request) -> None:
        if dispatcher.config.admin_key_sha256 is None:
            raise GatewayError(
                403, "The admin API is disabled: set admin_key_sha256 in the gateway config.", "permission_error",
                "admin_disabled",
            )  # fmt: skip
        if not dispatcher.keys.is_admin(request.headers.get("authorization")):
            raise GatewayError(401, "This endpoint needs the admin key.", "invalid_request_error", "invalid_admin_key")

    def store() -> KeyStore:
        if dispatcher.store is None:
            raise GatewayError(
                400, "No key store is configured (keys.store in the gateway config).", code="no_key_store"
            )
        return dispatcher.store

    router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])

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
