"""The `async:` section of the gateway YAML: async jobs, webhooks, the Batch API and the gRPC listener.

async:
  store: jobs.db                  # SQLite job store (WAL); relative to the config file
  jobs: {concurrency: 4, max_attempts: 3, default_max_time_in_queue_s: 600, result_ttl_s: 86400}
  webhooks:
    timeout_s: 10
    max_attempts: 5               # first try included
    backoff_initial_s: 1
    backoff_max_s: 60
    allow: [127.0.0.0/8, hooks.internal]   # private/loopback targets allowed despite the SSRF guard
    signing_secret: whsec_...     # master secret; per-key secrets derive from it (default: generated, kept in the store)
  batch: {max_file_bytes: 104857600, max_requests: 50000}
  grpc: {port: 50051, host: 127.0.0.1}   # or `ember gateway --grpc-port`
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from pydantic import Field, field_validator

from ember.strict_model import StrictModel


class JobsConfig(StrictModel):
    concurrency: int = Field(default=4, gt=0, description="Async and batch jobs running at once")
    max_attempts: int = Field(
        default=3, ge=1, description="Runs per job, counting re-runs after a gateway crash or replica failure"
    )
    default_max_time_in_queue_s: float = Field(
        default=600.0, gt=0, description="A job not started within this time expires"
    )
    max_time_in_queue_limit_s: float = Field(
        default=72 * 3600.0, gt=0, description="Largest max_time_in_queue_seconds a request may ask for"
    )
    result_ttl_s: float = Field(default=24 * 3600.0, gt=0, description="Finished jobs are deleted after this")
    poll_interval_s: float = Field(default=0.5, gt=0, description="Sweep for expired jobs and new work")


class WebhooksConfig(StrictModel):
    timeout_s: float = Field(default=10.0, gt=0)
    max_attempts: int = Field(default=5, ge=1, description="Deliveries tried per job, first one included")
    backoff_initial_s: float = Field(default=1.0, ge=0)
    backoff_max_s: float = Field(default=60.0, ge=0)
    allow: list[str] = Field(
        default_factory=list,
        description="CIDRs or host names that may be webhook targets although private, loopback or reserved",
    )
    signing_secret: str | None = Field(
        default=None, description="whsec_<base64> master secret; per-key secrets derive from it"
    )

    @field_validator("allow")
    @classmethod
    def _valid_entries(cls, entries: list[str]) -> list[str]:
        for entry in entries:
            if "/" in entry:
                try:
                    ipaddress.ip_network(entry, strict=False)
                except ValueError as exc:
                    raise ValueError(f"{entry!r} is not a valid CIDR: {exc}") from None
        return [entry.lower() for entry in entries]

    @field_validator("signing_secret")
    @classmethod
    def _whsec(cls, secret: str | None) -> str | None:
        if secret is not None and not secret.startswith("whsec_"):
            raise ValueError("must start with whsec_ followed by base64")
        return secret


class BatchConfig(StrictModel):
    max_file_bytes: int = Field(default=100 * 1024 * 1024, gt=0)
    max_requests: int = Field(default=50_000, gt=0, description="Lines per batch input file")


class GrpcConfig(StrictModel):
    port: int | None = Field(
        default=None, ge=0, le=65535, description="Off unless set here or by --grpc-port"
    )
    host: str = "127.0.0.1"


class AsyncConfig(StrictModel):
    store: Path | None = Field(
        default=None, description="SQLite job store, relative to the config file; default ./ember-jobs.db"
    )
    jobs: JobsConfig = Field(default_factory=JobsConfig)
    webhooks: WebhooksConfig = Field(default_factory=WebhooksConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    grpc: GrpcConfig = Field(default_factory=GrpcConfig)

    def store_path(self, base_dir: Path | None = None) -> Path:
        """A configured relative path is relative to the config file; the default is in the working
        directory (the config may sit in a read-only or packaged folder, like `ember up`'s default fleet)."""
        if self.store is None:
            return Path.cwd() / "ember-jobs.db"
        if not self.store.is_absolute() and base_dir is not None:
            return base_dir / self.store
        return self.store
