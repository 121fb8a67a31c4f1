"""`ember keys create|list|revoke|hash`: manage the gateway's API keys (hashes only): the SQLite store
(--db, or keys.store of --config), or PostgreSQL when --config has `state: {backend: shared}` (docs/ha.md)
- there, as through any gateway's admin API, every running gateway sees a new or revoked key at once."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from ember.errors import EmberError

if TYPE_CHECKING:
    from ember.gateway.config import KeyPolicy
    from ember.gateway.keys import StoredKey
    from ember.gateway.shared.config import StateConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "keys",
        help="Create, list and revoke gateway API keys",
        description="Manage the gateway's API keys. The store is --db, or keys.store in --config, or with "
        "`state: {backend: shared}` in --config its PostgreSQL (the keys every gateway of that state shares).",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    def store_args(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--db", help="SQLite key store file (created if missing)")
        sub.add_argument(
            "--config",
            help="Gateway config whose keys.store (or, with state.backend shared, whose PostgreSQL) to use "
            "instead of --db",
        )

    create = actions.add_parser("create", help="Create a key and print it (shown only this once)")
    store_args(create)
    create.add_argument("--name", required=True, help="A name for the key (unique among live keys)")
    create.add_argument(
        "--models", default="*", help='Comma-separated model names it may use (default "*": all)'
    )
    create.add_argument(
        "--endpoints",
        help="Comma-separated API surfaces it may use: chat, completions, batch, async, admin "
        "(default: all but admin)",
    )
    create.add_argument(
        "--priority",
        type=int,
        default=0,
        help="Queue tier: a higher number is served first, by the gateway's queue and by the replicas' engines",
    )
    create.add_argument(
        "--max-priority", type=int, help="Highest tier a request may ask for (default --priority)"
    )
    create.add_argument("--rpm", type=int, help="Requests per minute")
    create.add_argument("--tpm", type=int, help="Tokens per minute (prompt + completion)")
    create.add_argument("--max-concurrent", type=int, help="Max requests in flight at once")
    create.add_argument("--token-budget", type=int, help="Total tokens the key may ever use")
    create.add_argument("--deadline-ms", type=int, help="Default queueing deadline of its requests, in ms")
    create.add_argument("--json", action="store_true", help="Print the result as JSON")
    create.set_defaults(func=run_create)

    listing = actions.add_parser("list", help="List keys (never the keys themselves)")
    store_args(listing)
    listing.add_argument("--all", action="store_true", help="Include revoked keys")
    listing.add_argument("--json", action="store_true", help="Print JSON")
    listing.set_defaults(func=run_list)

    revoke = actions.add_parser("revoke", help="Revoke a key by id or name (takes effect at once)")
    store_args(revoke)
    revoke.add_argument("key", help="The key's id or name")
    revoke.set_defaults(func=run_revoke)

    hash_ = actions.add_parser(
        "hash", help="Print the SHA-256 digest of a key, for admin_key_sha256 or inline keys"
    )
    hash_.add_argument("key", nargs="?", help="The key; without it a new random key is generated and printed")
    hash_.set_defaults(func=run_hash)


def open_store(args: argparse.Namespace):
    from ember.gateway.config import load_config
    from ember.gateway.keys import KeyStore

    if args.db and args.config:
        raise EmberError("give either --db or --config, not both")
    if args.db:
        return KeyStore(Path(args.db))
    if args.config:
        config = load_config(args.config)
        if config.state.backend == "shared":
            return SharedKeysSession(config.state)
        store = config.keys.store
        if store is None:
            raise EmberError(f"{args.config} has no keys.store; add one or pass --db")
        return KeyStore(store)
    raise EmberError("say which key store to use: --db FILE or --config fleet.yaml")


class SharedKeysSession:
    """The PostgreSQL key store (ember.gateway.shared.keys) behind the SQLite store's synchronous methods,
    on one event loop for the command's life. Revoking also marks the key in Redis, as a gateway does."""

    def __init__(self, state_config: StateConfig) -> None:
        import asyncio

        from ember.gateway.shared.connection import SharedState
        from ember.gateway.shared.keys import SharedKeyStore

        self._loop = asyncio.new_event_loop()
        self._state = SharedState(state_config)
        try:
            self._loop.run_until_complete(self._state.open())  # SharedStateError (one line) when unreachable
        except BaseException:
            self._loop.close()
            raise
        self._store = SharedKeyStore(self._state)

    def create(self, name: str, policy: KeyPolicy) -> tuple[str, StoredKey]:
        return self._loop.run_until_complete(self._store.create(name, policy))

    def list(self, include_revoked: bool = False) -> list[StoredKey]:
        return self._loop.run_until_complete(self._store.list(include_revoked))

    def revoke(self, id_or_name: str) -> StoredKey:
        return self._loop.run_until_complete(self._store.revoke(id_or_name))

    def close(self) -> None:
        self._loop.run_until_complete(self._state.close())
        self._loop.close()


def run_create(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from ember.gateway.config import KeyPolicy, validation_message

    models = comma_list(args.models)
    scope = {} if args.endpoints is None else {"endpoints": comma_list(args.endpoints)}
    try:
        policy = KeyPolicy(
            models=models or ["*"],
            **scope,
            priority=args.priority,
            max_priority=args.max_priority,
            rpm=args.rpm,
            tpm=args.tpm,
            max_concurrent=args.max_concurrent,
            token_budget=args.token_budget,
            default_deadline_ms=args.deadline_ms,
        )
    except ValidationError as exc:
        raise EmberError(validation_message("key options", exc)) from None
    store = open_store(args)
    try:
        key, record = store.create(args.name, policy)
    finally:
        store.close()
    if args.json:
        print(json.dumps({"key": key, **record.to_dict()}))
    else:
        print(key)
        print(f"id: {record.id}  name: {record.name}  (store this key now: it is not shown again)")
    return 0


def comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def run_list(args: argparse.Namespace) -> int:
    store = open_store(args)
    try:
        records = store.list(include_revoked=args.all)
    finally:
        store.close()
    if args.json:
        print(json.dumps([record.to_dict() for record in records]))
        return 0
    print(
        f"{'ID':<17} {'NAME':<20} {'KEY':<16} {'MODELS':<20} {'ENDPOINTS':<32} {'TIER':>4} {'RPM':>6} {'TPM':>8}  STATUS"
    )
    for record in records:
        policy = record.policy
        status = "revoked" if record.revoked_at else "live"
        print(
            f"{record.id:<17} {record.name:<20} {record.display:<16} {','.join(policy.models):<20} "
            f"{','.join(policy.endpoints):<32} {policy.priority:>4} {policy.rpm or '-':>6} {policy.tpm or '-':>8}  {status}"
        )
    return 0


def run_revoke(args: argparse.Namespace) -> int:
    store = open_store(args)
    try:
        record = store.revoke(args.key)
    finally:
        store.close()
    print(f"revoked {record.name} ({record.id})")
    return 0


def run_hash(args: argparse.Namespace) -> int:
    from ember.gateway.keys import generate_key, hash_key

    key = args.key or generate_key()
    if not args.key:
        print(f"key:    {key}")
    print(f"sha256: {hash_key(key)}" if not args.key else hash_key(key))
    return 0
