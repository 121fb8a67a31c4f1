"""The `state:` section of the gateway YAML: where keys, usage, limits and async jobs live.

    state: {backend: embedded}          # default: SQLite files and in-process buckets, as for one gateway
    state:                              # any number of gateways share one PostgreSQL and one Redis
      backend: shared
      postgres: {dsn: "postgresql://ember@db:5432/ember", schema: ember, job_lease_s: 30}
      redis: {url: "redis://cache:6379/0", key_prefix: ember, lease_s: 900}

See docs/ha.md for what each store holds and how failures behave.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from ember.strict_model import StrictModel

SQL_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


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
