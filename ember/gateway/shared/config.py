"""The `state:` section of the gateway YAML: where keys, usage, limits and async jobs live.

    state: {backend: embedded}          # default: SQLite files and in-process buckets, as for one gateway
    state:                              # any number of gateways share one PostgreSQL and one Redis
      backend: shared
      postgres: {dsn: "postgresql://ember@db:5432/ember", schema: ember, job_lease_s: 30}
      redis: {url: "redis://cache:6379/0", key_prefix: ember, lease_s: 900}
      # dsn_env / url_env: VARIABLE in place of dsn / url keeps a password out of the file

See docs/ha.md for what each store holds and how failures behave.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ember.strict_model import StrictModel

SQL_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def _from_env(data: Any, field: str) -> Any:
    """`<field>_env: VARIABLE` in place of `<field>`, to keep a password out of the file; the variable
    must be set when the file is loaded."""
    if not isinstance(data, dict) or f"{field}_env" not in data:
        return data
    if field in data:
        raise ValueError(f"set {field} or {field}_env, not both")
    data = dict(data)
    variable = data.pop(f"{field}_env")
    value = os.environ.get(str(variable))
    if not value:
        raise ValueError(f"{field}_env: environment variable {variable!r} is not set")
    data[field] = value
    return data


class PostgresConfig(StrictModel):
    dsn: str = Field(description="libpq connection URI, e.g. postgresql://user:password@host:5432/database")
    schema_: str = Field(default="ember", alias="schema", description="Schema holding Ember's tables")
    min_connections: int = Field(default=1, ge=0)
    max_connections: int = Field(default=10, gt=0)
    job_lease_s: float = Field(
        default=30.0,
        gt=0,
        description="A running async job (or webhook delivery) whose gateway stops renewing it for this long is taken over",
    )

    @model_validator(mode="before")
    @classmethod
    def _dsn_env(cls, data: Any) -> Any:
        return _from_env(data, "dsn")

    @field_validator("dsn")
    @classmethod
    def _postgres_uri(cls, dsn: str) -> str:
        if not dsn.startswith(("postgresql://", "postgres://")):
            raise ValueError("must be a postgresql:// URI")
        return dsn

    @field_validator("schema_")
    @classmethod
    def _identifier(cls, schema: str) -> str:
        if not SQL_IDENTIFIER.match(schema):
            raise ValueError("must be a lower-case SQL identifier (letters, digits, underscores)")
        return schema


class RedisConfig(StrictModel):
    url: str = Field(description="redis:// or rediss:// URL, e.g. redis://127.0.0.1:6379/0")
    key_prefix: str = Field(
        default="ember", min_length=1, description="Prefix of every Redis key Ember writes"
    )
    lease_s: float = Field(
        default=900.0,
        gt=0,
        description="How long a request's concurrency slot and budget reservation outlive a gateway that died holding them",
    )

    @model_validator(mode="before")
    @classmethod
    def _url_env(cls, data: Any) -> Any:
        return _from_env(data, "url")

    @field_validator("url")
    @classmethod
    def _redis_url(cls, url: str) -> str:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must be a redis://, rediss:// or unix:// URL")
        return url


class StateConfig(StrictModel):
    backend: Literal["embedded", "shared"] = "embedded"
    postgres: PostgresConfig | None = None
    redis: RedisConfig | None = None

    @model_validator(mode="after")
    def _stores_match_backend(self) -> StateConfig:
        if self.backend == "shared" and (self.postgres is None or self.redis is None):
            raise ValueError("backend 'shared' needs both postgres: {dsn} and redis: {url}")
        if self.backend == "embedded" and (self.postgres is not None or self.redis is not None):
            raise ValueError("postgres and redis are used only with backend: shared")
        return self

    @property
    def shared(self) -> bool:
        return self.backend == "shared"
