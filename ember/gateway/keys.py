"""API keys: stored only as SHA-256 digests (SQLite by default, plus inline entries in the config),
compared in constant time, cached in memory so the proxy path never touches the disk.

A key looks like `sk-ember-<43 url-safe chars>`; it is shown once, at creation. The store keeps its
digest, a short display prefix and the policy (ember.gateway.config.KeyPolicy) as JSON.
Revocations made by another process (`ember keys revoke`) are seen at once: SQLite's
`PRAGMA data_version` changes whenever another connection commits, and that empties the cache.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pydantic import ValidationError

from ember.errors import EmberError
from ember.gateway.config import GatewayConfig, KeyEndpoint, KeyPolicy, validation_message
from ember.gateway.errors import GatewayError
from ember.http_rules import parse_bearer

KEY_PREFIX = "sk-ember-"
DISPLAY_CHARS = 12

SCHEMA = """
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    sha256 TEXT NOT NULL UNIQUE,
    display TEXT NOT NULL,
    policy TEXT NOT NULL,
    created_at REAL NOT NULL,
    revoked_at REAL
);
CREATE UNIQUE INDEX IF NOT EXISTS api_keys_live_name ON api_keys(name) WHERE revoked_at IS NULL;
CREATE TABLE IF NOT EXISTS key_usage (
    key_id TEXT PRIMARY KEY,
    requests INTEGER NOT NULL DEFAULT 0,
    prompt_tokens INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0
);
"""


class KeyStoreError(EmberError):
    """A key store operation failed (unknown key, duplicate name, unreadable database)."""


def invalid_api_key() -> GatewayError:
    """The 401 of an unknown or revoked key."""
    return GatewayError(401, "Incorrect API key provided.", "invalid_request_error", "invalid_api_key")


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller behind an API key."""

    key_id: str  # "inline:<name>" or the store's id
    name: str
    policy: KeyPolicy


@dataclass(frozen=True, slots=True)
class StoredKey:
    id: str
    name: str
    display: str  # the key's first characters, to recognise it in listings
    policy: KeyPolicy
    created_at: float
    revoked_at: float | None

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "name": self.name,
            "display": self.display,
            "created_at": self.created_at,
            "revoked_at": self.revoked_at,
            **self.policy.model_dump(),
        }


class KeyStore:
    """SQLite-backed key store. Calls are short and synchronous; one connection guarded by a lock."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(SCHEMA)
        except sqlite3.Error as exc:
            raise KeyStoreError(f"cannot open key store {self.path}: {exc}") from None
        self._lock = threading.Lock()

    def close(self) -> None:
        self._db.close()

    def data_version(self) -> int:
        with self._lock:
            return self._db.execute("PRAGMA data_version").fetchone()[0]

    def create(self, name: str, policy: KeyPolicy) -> tuple[str, StoredKey]:
        """Returns the plaintext key (shown once) and its stored record."""
        if not name.strip():
            raise KeyStoreError("a key needs a non-empty name")
        key = generate_key()
        record = StoredKey(
            id=uuid.uuid4().hex[:16],
            name=name,
            display=key[:DISPLAY_CHARS] + "...",
            policy=policy,
            created_at=time.time(),
            revoked_at=None,
        )
        try:
            with self._lock:
                self._db.execute(
                    "INSERT INTO api_keys (id, name, sha256, display, policy, created_at) VALUES (?,?,?,?,?,?)",
                    (
                        record.id,
                        name,
                        hash_key(key),
                        record.display,
                        policy.model_dump_json(),
                        record.created_at,
                    ),
                )
        except sqlite3.IntegrityError:
            raise KeyStoreError(f"a live key named {name!r} already exists") from None
        return key, record

    def list(self, include_revoked: bool = False) -> list[StoredKey]:
        query = "SELECT id, name, display, policy, created_at, revoked_at FROM api_keys"
        if not include_revoked:
            query += " WHERE revoked_at IS NULL"
        with self._lock:
            rows = self._db.execute(query + " ORDER BY created_at").fetchall()
        return [self._record(row) for row in rows]

    def get(self, id_or_name: str) -> StoredKey:
        with self._lock:
            row = self._db.execute(
                "SELECT id, name, display, policy, created_at, revoked_at FROM api_keys "
                "WHERE id = ? OR (name = ? AND revoked_at IS NULL) ORDER BY revoked_at IS NULL DESC LIMIT 1",
                (id_or_name, id_or_name),
            ).fetchone()
        if row is None:
            raise KeyStoreError(f"no key with id or name {id_or_name!r}")
        return self._record(row)

    def revoke(self, id_or_name: str) -> StoredKey:
        record = self.get(id_or_name)
        if record.revoked_at is not None:
            raise KeyStoreError(f"key {record.name!r} ({record.id}) is already revoked")
        revoked_at = time.time()
        with self._lock:
            self._db.execute("UPDATE api_keys SET revoked_at = ? WHERE id = ?", (revoked_at, record.id))
        return StoredKey(record.id, record.name, record.display, record.policy, record.created_at, revoked_at)

    def find(self, digest: str) -> tuple[str, StoredKey] | None:
        """The live key whose digest is `digest`, with the stored digest for a constant-time compare."""
        with self._lock:
            row = self._db.execute(
                "SELECT id, name, display, policy, created_at, revoked_at, sha256 FROM api_keys "
                "WHERE sha256 = ? AND revoked_at IS NULL",
                (digest,),
            ).fetchone()
        return None if row is None else (row[6], self._record(row[:6]))

    # --- usage persistence (ember.gateway.usage keeps the live counters) --------------------------

    def load_usage(self) -> dict[str, tuple[int, int, int]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT key_id, requests, prompt_tokens, completion_tokens FROM key_usage"
            )
            return {row[0]: (row[1], row[2], row[3]) for row in rows.fetchall()}

    def add_usage(self, deltas: dict[str, tuple[int, int, int]]) -> None:
        with self._lock:
            self._db.executemany(
                "INSERT INTO key_usage (key_id, requests, prompt_tokens, completion_tokens) VALUES (?,?,?,?) "
                "ON CONFLICT(key_id) DO UPDATE SET requests = requests + excluded.requests, "
                "prompt_tokens = prompt_tokens + excluded.prompt_tokens, "
                "completion_tokens = completion_tokens + excluded.completion_tokens",
                [(key_id, *delta) for key_id, delta in deltas.items()],
            )

    def _record(self, row: tuple) -> StoredKey:
        try:
            policy = KeyPolicy.model_validate_json(row[3])
        except ValidationError as exc:
            raise KeyStoreError(validation_message(f"key {row[1]!r} in {self.path}", exc)) from None
        return StoredKey(row[0], row[1], row[2], policy, row[4], row[5])


def require_endpoint(principal: Principal, endpoint: KeyEndpoint) -> None:
    """A 403 unless the key's `endpoints` scope includes `endpoint`."""
    if not principal.policy.allows_endpoint(endpoint):
        raise GatewayError(
            403,
            f"API key {principal.name!r} may not use the {endpoint} endpoint; it may use: "
            f"{', '.join(principal.policy.endpoints)}.",
            "permission_error",
            "endpoint_not_allowed",
        )


class SharedKeyLookup(Protocol):
    def find(self, digest: str) -> Principal | None: ...


class KeyRing:
    """Authenticates bearer tokens against inline keys and the key store, with an in-memory cache.
    `shared_keys` (ember.gateway.shared.keys.SharedKeyStore) holds PostgreSQL's live keys in memory."""

    def __init__(
        self, config: GatewayConfig, store: KeyStore | None, shared_keys: SharedKeyLookup | None = None
    ):
        self.store = store
        self.shared_keys = shared_keys
        self._inline = {
            key.sha256: Principal(
                f"inline:{key.name}", key.name, KeyPolicy(**key.model_dump(exclude={"name", "sha256"}))
            )
            for key in config.keys.inline
        }
        self._admin_digest = config.admin_key_sha256
        self._cache: dict[str, Principal | None] = {}
        self._store_version = store.data_version() if store else 0

    def authenticate(self, authorization: str | None) -> Principal:
        token = parse_bearer(authorization)
        if token is None:
            raise GatewayError(
                401,
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
                "invalid_request_error",
                "missing_api_key",
            )
        digest = hash_key(token)
        # Lookups are keyed by the digest, so their timing says nothing about the key itself.
        principal = self._inline.get(digest)
        if principal is None and self.store is not None:
            principal = self._lookup_store(digest)
        if principal is None and self.shared_keys is not None:
            principal = self.shared_keys.find(digest)
        if principal is None:
            raise invalid_api_key()
        return principal

    def find(self, authorization: str | None) -> Principal | None:
        """The key's principal, or None for a missing or unknown key."""
        try:
            return self.authenticate(authorization)
        except GatewayError:
            return None

    def is_admin(self, authorization: str | None) -> bool:
        token = parse_bearer(authorization)
        if token is None or self._admin_digest is None:
            return False
        return hmac.compare_digest(hash_key(token), self._admin_digest)

    def invalidate(self) -> None:
        self._cache.clear()

    def _lookup_store(self, digest: str) -> Principal | None:
        version = self.store.data_version()
        if version != self._store_version:
            self._store_version = version
            self._cache.clear()
        if digest in self._cache:
            return self._cache[digest]
        found = self.store.find(digest)
        principal = None
        if found is not None:
            stored_digest, record = found
            if hmac.compare_digest(stored_digest, digest):
                principal = Principal(record.id, record.name, record.policy)
        if len(self._cache) > 100_000:  # unknown-key floods must not grow memory without bound
            self._cache.clear()
        self._cache[digest] = principal
        return principal
