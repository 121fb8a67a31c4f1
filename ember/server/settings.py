"""Server options (everything `ember serve` takes beyond the engine's own flags)."""

from __future__ import annotations

from dataclasses import dataclass

from ember.errors import EmberError

# The default of `ember serve --api-key`; `ember up` hands its replicas their key this way, not in argv.
API_KEY_ENV = "EMBER_API_KEY"


@dataclass
class ServerSettings:
    served_model_names: tuple[str, ...]
    api_key: str | None = None
    metrics_require_auth: bool = False  # /metrics needs the api_key too
    max_queued_requests: int | None = None  # None: unbounded
    max_queued_tokens: int | None = None  # None: unbounded
    queue_timeout: float | None = None  # seconds a request may wait for the engine; None: forever
    drain_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    max_request_body_bytes: int = 32 * 1024 * 1024
    retry_after_s: int = 1  # Retry-After sent with 429

    def __post_init__(self) -> None:
        if not self.served_model_names or any(not name for name in self.served_model_names):
            raise EmberError("served model names must be non-empty strings")
        for name in ("max_queued_requests", "max_queued_tokens", "max_request_body_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise EmberError(f"{name} must be at least 1, got {value}")
        if self.metrics_require_auth and not self.api_key:
            raise EmberError("--metrics-require-auth needs --api-key: /metrics would need a key that does not exist")
        for name in ("queue_timeout", "drain_timeout"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise EmberError(f"{name} must be >= 0 seconds, got {value}")
