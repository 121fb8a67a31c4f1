"""The gateway's one configuration file (YAML), validated with pydantic.

`load_config(path)` is the only entry point; a bad file raises `GatewayConfigError` whose message
names the dotted path of every bad field and why, e.g.
`fleet.yaml: models.tiny.deployments[0].replicas[1].capacity: Input should be greater than 0`.

Shape (every section but `models` is optional):

    listener_region: us-east            # the region this gateway listens in (default client region)
    admin_key_sha256: <hex>             # guards /admin/*; `ember keys hash` prints it
    regions:
      us-east: {latency_ms: {us-west: 70}}   # symmetric; a missing pair means "far" (infinite)
      us-west: {}
    models:
      tiny:                             # the name clients send as `model`
        routing: {policy: least-outstanding}
        autoscaling: {...}              # `ember up` starts/stops this model's replicas (AutoscalingConfig)
        deployments:
          - name: stable
            model: tiny-v1              # the model id the replicas serve (sent upstream as `model`)
            version: v1
            weight: 90                  # traffic share among this model's deployments (canaries)
            api_key_env: REPLICA_KEY    # the replicas' own key (vLLM --api-key), for all its replicas
            replicas:                   # or, on Kubernetes, instead of a list:
                                        #   discovery: {kubernetes: {service: NAME, port: http}}
              - url: http://127.0.0.1:8001
                region: us-east
                labels: {hw: cpu}
                capacity: 8             # max concurrent requests the gateway sends it
                api_key: <key>          # or per replica, overriding the deployment's (api_key_env too)
    keys:
      store: keys.db                    # SQLite key store (relative to this file); `ember keys` writes it
      inline:
        - {name: ci, sha256: <hex>, models: [tiny], endpoints: [chat, completions], priority: 1, rpm: 600}
    limits: {...}  timeouts: {...}  failover: {...}  health: {...}  scrape: {...}  queue: {...}
    metrics: {require_auth: false, key_labels: name}   # /metrics: admin key only?; key label: name | id | none
    async: {...}                        # async jobs / batch / webhooks (filled by that area)
    state: {backend: embedded}          # or shared: PostgreSQL + Redis for several gateways (docs/ha.md)
    clusters:                           # a front door over cluster gateways, in place of `models` (docs/ha.md)
      models: [tiny]
      members:
        east: {url: http://10.0.1.5:8080, region: us-east, capacity: 256, api_key_env: EAST_SERVICE_KEY}
    launch: {...}                       # `ember up` only: local replicas to start (ember.control.fleet)
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from ember.errors import EmberError
from ember.gateway.jobs.config import AsyncConfig  # the `async:` section (jobs, webhooks, batch, gRPC)
from ember.gateway.shared.config import StateConfig  # the `state:` section (embedded or PostgreSQL + Redis)
from ember.strict_model import StrictModel

# `ember up` hands its gateway the fleet's service credential in this variable, never in argv (`ps` shows argv).
FLEET_CREDENTIAL_ENV = "EMBER_FLEET_CREDENTIAL"
# The token the autoscaler calls the admin API with (`ember up` generates it; ember.gateway.admin accepts it).
CONTROL_TOKEN_ENV = "EMBER_GATEWAY_CONTROL_TOKEN"
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
ROUTING_POLICIES = (
    "round-robin",
    "least-outstanding",
    "load-aware",
    "prefix-cache",
    "session-affinity",
)


class GatewayConfigError(EmberError):
    """The gateway configuration file is missing, unreadable or invalid."""


class _ReplicaCredential(StrictModel):
    """The key the gateway sends a replica as `Authorization: Bearer <key>` (a replica started with
    vLLM's or `ember serve`'s --api-key). Never a client's key: those stay at the gateway."""

    api_key: str | None = Field(default=None, repr=False, description="The replica's key itself")
    api_key_env: str | None = Field(
        default=None, description="Environment variable holding the replica's key"
    )

    @model_validator(mode="after")
    def _one_source(self) -> _ReplicaCredential:
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError("set api_key or api_key_env, not both")
        if self.api_key_env is not None and not os.environ.get(self.api_key_env):
            raise ValueError(f"api_key_env: the environment variable {self.api_key_env} is not set")
        return self

    @property
    def sets_api_key(self) -> bool:
        return self.api_key is not None or self.api_key_env is not None

    @property
    def replica_api_key(self) -> str | None:
        if self.api_key_env is not None:
            return os.environ[self.api_key_env]
        return self.api_key


class ReplicaConfig(_ReplicaCredential):
    url: str = Field(description="Base URL of an OpenAI-compatible server, e.g. http://10.0.0.5:8000")
    id: str | None = Field(default=None, description="Stable name in metrics and logs; defaults to the URL")
    region: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    capacity: int = Field(default=16, gt=0, description="Max concurrent requests the gateway sends it")

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not re.match(r"^https?://[^/\s]+", url):
            raise ValueError(f"must be an http:// or https:// URL, got {url!r}")
        return url.rstrip("/")

    @property
    def replica_id(self) -> str:
        return self.id or self.url


class KubernetesDiscovery(StrictModel):
    """The ready endpoints of a Kubernetes Service are the deployment's replicas (ember.gateway.discovery)."""

    service: str = Field(description="The Service whose EndpointSlices list the replicas")
    namespace: str | None = Field(
        default=None, description="Default: the namespace the gateway's pod runs in"
    )
    port: str | int = Field(default="http", description="The Service port's name, or its number")
    scheme: Literal["http", "https"] = "http"
    capacity: int = Field(default=16, gt=0, description="Max concurrent requests the gateway sends each pod")
    region: str | None = None


class DiscoveryConfig(StrictModel):
    kubernetes: KubernetesDiscovery


class DeploymentConfig(_ReplicaCredential):
    name: str = "default"
    model: str | None = Field(
        default=None, description="Model id the replicas serve; defaults to the model name"
    )
    version: str | None = None
    weight: float = Field(default=1.0, ge=0)
    # Empty for an autoscaled model, whose replicas the autoscaler starts and registers, and for one
    # whose replicas are discovered.
    replicas: list[ReplicaConfig] = Field(default_factory=list)
    discovery: DiscoveryConfig | None = None

    @model_validator(mode="after")
    def _one_replica_source(self) -> DeploymentConfig:
        if self.replicas and self.discovery is not None:
            raise ValueError("list replicas or set discovery, not both")
        return self


class AutoscalingConfig(StrictModel):
    """A model whose replica count follows its load (ember.control.autoscaling): enough replicas to
    keep the p90 objectives, as few as possible, none at all after `scale_to_zero_after_s` idle when
    `min_replicas` is 0 (the gateway then holds arriving requests while one starts)."""

    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(ge=1)
    ttft_p90_ms: float = Field(gt=0, description="Objective: p90 time to first token at the gateway")
    itl_p90_ms: float = Field(gt=0, description="Objective: p90 inter-token latency on the replicas")
    queue_wait_p90_ms: float | None = Field(
        default=None, gt=0, description="Objective: p90 gateway queue wait"
    )
    scale_up_delay_s: float = Field(
        default=0.0, ge=0, description="How long a breach lasts before scaling up"
    )
    scale_down_delay_s: float = Field(
        default=60.0, ge=0, description="How long one replica fewer must suffice"
    )
    scale_to_zero_after_s: float = Field(
        default=300.0, gt=0, description="Idle time before 1 -> 0 (min 0 only)"
    )
    cost_per_replica_hour: float = Field(default=0.0, ge=0, description="For reports")
    stable_window_s: float = Field(
        default=30.0, gt=0, description="Window of the p90s that scale up and down"
    )
    panic_window_s: float = Field(default=6.0, gt=0, description="Short window that only scales up")
    hold_limit: int = Field(
        default=64, ge=0, description="Requests held while the model has no ready replica"
    )

    @model_validator(mode="after")
    def _ordered(self) -> AutoscalingConfig:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) is below min_replicas ({self.min_replicas})"
            )
        if self.panic_window_s > self.stable_window_s:
            raise ValueError(
                f"panic_window_s ({self.panic_window_s}) is longer than stable_window_s ({self.stable_window_s})"
            )
        return self


class RoutingConfig(StrictModel):
    policy: Literal[ROUTING_POLICIES] = "least-outstanding"  # type: ignore[valid-type]
    # Policy-specific knobs (prefix length, load bound, session header, ...), read by ember.gateway.routing.
    options: dict[str, Any] = Field(default_factory=dict)
    # Client region -> nearest region with healthy capacity; off means regions are ignored for this model.
    region_aware: bool = True
    spill_when_waiting: int | None = Field(
        default=None,
        ge=1,
        description="Leave a region whose replicas' scraped /metrics show this many requests waiting (or, for "
        "cluster gateways, every healthy replica's slots taken) as if it were at capacity; "
        "default off, 1 for a front door's clusters",
    )


class GatewayModelConfig(StrictModel):
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    deployments: list[DeploymentConfig] = Field(min_length=1)
    autoscaling: AutoscalingConfig | None = None

    @model_validator(mode="after")
    def _unique_deployments(self) -> GatewayModelConfig:
        names = [deployment.name for deployment in self.deployments]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"deployment names must be unique, repeated: {', '.join(duplicates)}")
        if not any(deployment.weight > 0 for deployment in self.deployments):
            raise ValueError("at least one deployment needs a weight above 0")
        return self


class RegionConfig(StrictModel):
    latency_ms: dict[str, float] = Field(default_factory=dict)

    @field_validator("latency_ms")
    @classmethod
    def _non_negative(cls, latencies: dict[str, float]) -> dict[str, float]:
        for region, latency in latencies.items():
            if latency < 0:
                raise ValueError(f"latency to {region!r} must be >= 0, got {latency}")
        return latencies


# The API surfaces a key can be scoped to: /v1/chat/completions (and WebSocket/gRPC chat),
# /v1/completions (and WebSocket/gRPC prompts), /v1/files + /v1/batches, /v1/async/*, /admin/*.
KeyEndpoint = Literal["chat", "completions", "batch", "async", "admin"]
DEFAULT_KEY_ENDPOINTS: tuple[KeyEndpoint, ...] = ("chat", "completions", "batch", "async")


class KeyPolicy(StrictModel):
    """What one API key may do. Shared by inline keys and the SQLite key store (stored as this
    model's JSON, so a key stored before a field existed reads that field's default)."""

    models: list[str] = Field(default_factory=lambda: ["*"], description='Model names it may use; "*" = all')
    endpoints: list[KeyEndpoint] = Field(
        default_factory=lambda: list(DEFAULT_KEY_ENDPOINTS),
        min_length=1,
        description="API surfaces it may use; default: all but admin",
    )
    priority: int = Field(default=0, ge=0, description="Queue tier; a higher tier is served first")
    max_priority: int | None = Field(
        default=None,
        ge=0,
        description="Highest tier a request may ask for (x-ember-priority); default: priority",
    )
    rpm: int | None = Field(default=None, gt=0, description="Requests per minute")
    tpm: int | None = Field(default=None, gt=0, description="Tokens (prompt + completion) per minute")
    max_concurrent: int | None = Field(default=None, gt=0)
    token_budget: int | None = Field(default=None, gt=0, description="Total tokens this key may ever use")
    default_deadline_ms: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _priority_range(self) -> KeyPolicy:
        if self.max_priority is not None and self.max_priority < self.priority:
            raise ValueError(f"max_priority ({self.max_priority}) is below priority ({self.priority})")
        return self

    @property
    def highest_priority(self) -> int:
        return self.priority if self.max_priority is None else self.max_priority

    def allows_model(self, model: str) -> bool:
        return "*" in self.models or model in self.models

    def allows_endpoint(self, endpoint: KeyEndpoint) -> bool:
        return endpoint in self.endpoints


class InlineKeyConfig(KeyPolicy):
    name: str
    sha256: str = Field(description="SHA-256 hex digest of the key; the key itself never appears in config")

    @field_validator("sha256")
    @classmethod
    def _hex_digest(cls, digest: str) -> str:
        digest = digest.lower()
        if not SHA256_HEX.match(digest):
            raise ValueError("must be a 64-character hex SHA-256 digest (`ember keys hash` prints one)")
        return digest


class KeysConfig(StrictModel):
    store: Path | None = Field(default=None, description="SQLite key store; relative to the config file")
    inline: list[InlineKeyConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_names(self) -> KeysConfig:
        names = [key.name for key in self.inline]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"inline key names must be unique, repeated: {', '.join(duplicates)}")
        return self


class LimitsConfig(StrictModel):
    max_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    default_max_tokens: int = Field(
        default=256, gt=0, description="Assumed completion length for TPM estimates when max_tokens is absent"
    )


class TimeoutsConfig(StrictModel):
    connect_s: float = Field(default=2.0, gt=0)
    read_s: float = Field(
        default=120.0, gt=0, description="Max wait for the replica's response headers and between two chunks"
    )


class FailoverConfig(StrictModel):
    max_attempts: int = Field(default=3, ge=1, description="Replicas tried per request before giving up")


class HealthConfig(StrictModel):
    path: str = "/health"
    interval_s: float = Field(default=2.0, gt=0)
    timeout_s: float = Field(default=1.0, gt=0)
    unhealthy_threshold: int = Field(default=3, ge=1, description="Consecutive failures that eject a replica")
    healthy_threshold: int = Field(default=1, ge=1, description="Consecutive successes that re-admit it")


class ScrapeConfig(StrictModel):
    path: str = "/metrics"
    interval_s: float = Field(default=1.0, gt=0)
    timeout_s: float = Field(default=1.0, gt=0)


class QueueConfig(StrictModel):
    max_size: int = Field(default=1024, ge=0, description="Waiting requests per model; beyond it -> 429")
    default_deadline_ms: int = Field(default=30_000, gt=0, description="When neither header nor key sets one")


class MetricsConfig(StrictModel):
    """The gateway's own `GET /metrics`."""

    require_auth: bool = Field(default=False, description="Serve /metrics only to the admin key")
    key_labels: Literal["name", "id", "none"] = Field(
        default="name",
        description="What the `key` label of per-key metrics holds: the key's name, its id, or nothing",
    )
    replica_price_per_hour: float | None = Field(
        default=None,
        ge=0,
        description="What one replica costs per hour, for the console's cost per 1M output tokens",
    )


class ClustersConfig(StrictModel):
    """A front door: this gateway serves `models` through other gateways (clusters), each with its own
    replicas. Expanded at load into one model per name whose replicas are the cluster gateways, so the
    routing of docs/routing.md applies: nearest healthy cluster first by the regions' latency matrix,
    spill-over when one is at capacity or its scraped queue is building (`routing.spill_when_waiting`,
    1 unless set), ejection when its `/ready` fails (the health path becomes `/ready` unless
    `health.path` is set) or its requests fail, probed back afterwards."""

    models: list[str] = Field(min_length=1, description="Model names every cluster serves")
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    # A cluster: its gateway's URL, region, capacity (concurrent requests sent to it) and the service
    # credential (an API key of that gateway) the front door sends in place of the client's key.
    members: dict[str, ReplicaConfig] = Field(min_length=1)


def _expand_clusters(data: Any) -> Any:
    """`clusters:` -> `models:` whose replicas are the cluster gateways (ids `<cluster>/<model>`)."""
    if not isinstance(data, dict) or "clusters" not in data:
        return data
    if data.get("models"):
        raise ValueError("a front door (clusters) serves clusters.models; leave models out")
    clusters = ClustersConfig.model_validate(data["clusters"])
    members = [
        (name, member.model_dump(exclude={"id"}, exclude_none=True))
        for name, member in clusters.members.items()
    ]
    routing = clusters.routing.model_dump()
    if "spill_when_waiting" not in clusters.routing.model_fields_set:
        routing["spill_when_waiting"] = 1  # a cluster with a request in its queue is spilled from
    models = {
        model: {
            "routing": routing,
            "deployments": [
                {
                    "name": "clusters",
                    "replicas": [{**member, "id": f"{name}/{model}"} for name, member in members],
                }
            ],
        }
        for model in clusters.models
    }
    health = dict(data.get("health") or {})
    health.setdefault("path", "/ready")
    return {**data, "models": models, "health": health}


class GatewayConfig(StrictModel):
    listener_region: str | None = None
    admin_key_sha256: str | None = None
    regions: dict[str, RegionConfig] = Field(default_factory=dict)
    models: dict[str, GatewayModelConfig] = Field(min_length=1)
    keys: KeysConfig = Field(default_factory=KeysConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig)
    failover: FailoverConfig = Field(default_factory=FailoverConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    scrape: ScrapeConfig = Field(default_factory=ScrapeConfig)
    queue: QueueConfig = Field(default_factory=QueueConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")
    state: StateConfig = Field(default_factory=StateConfig)
    # `ember up`'s section (which local replicas to start, and how); the gateway ignores it and
    # ember.control.fleet validates it, so one fleet file serves both.
    launch: dict[str, Any] | None = None
    clusters: ClustersConfig | None = None  # a front door over cluster gateways; fills `models`

    model_config = ConfigDict(populate_by_name=True)  # merged with StrictModel's: "async" or async_
    # The config file's folder: relative paths in any section (key store, job store) resolve against it.
    _base_dir: Path | None = PrivateAttr(default=None)

    @property
    def base_dir(self) -> Path | None:
        return self._base_dir

    @model_validator(mode="before")
    @classmethod
    def _clusters_to_models(cls, data: Any) -> Any:
        return _expand_clusters(data)

    @field_validator("admin_key_sha256")
    @classmethod
    def _admin_digest(cls, digest: str | None) -> str | None:
        if digest is None:
            return None
        digest = digest.lower()
        if not SHA256_HEX.match(digest):
            raise ValueError("must be a 64-character hex SHA-256 digest (`ember keys hash` prints one)")
        return digest

    @model_validator(mode="after")
    def _cross_references(self) -> GatewayConfig:
        known = set(self.regions)
        problems: list[str] = []
        if self.metrics.require_auth and self.admin_key_sha256 is None:
            problems.append(
                "metrics.require_auth needs admin_key_sha256: only the admin key may read /metrics"
            )
        if self.state.shared and self.keys.store is not None:
            problems.append(
                "keys.store is the embedded SQLite key store: with state.backend shared, keys live in PostgreSQL"
            )
        if self.listener_region is not None and known and self.listener_region not in known:
            problems.append(f"listener_region {self.listener_region!r} is not declared under regions")
        for region, region_config in self.regions.items():
            for other in region_config.latency_ms:
                if other not in known:
                    problems.append(f"regions.{region}.latency_ms names undeclared region {other!r}")
        seen_ids: dict[str, str] = {}
        for model_name, model in self.models.items():
            problems.extend(_replica_source_problems(model_name, model))
            for d_index, deployment in enumerate(model.deployments):
                for r_index, replica in enumerate(deployment.replicas):
                    where = f"models.{model_name}.deployments[{d_index}].replicas[{r_index}]"
                    if replica.region is not None and known and replica.region not in known:
                        problems.append(f"{where}.region {replica.region!r} is not declared under regions")
                    previous = seen_ids.get(replica.replica_id)
                    if previous is not None:
                        problems.append(
                            f"{where}: replica id {replica.replica_id!r} already used at {previous}"
                        )
                    seen_ids[replica.replica_id] = where
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def latency_ms(self, source: str, target: str) -> float:
        """Symmetric latency between two regions; 0 within a region, infinity when undeclared."""
        if source == target:
            return 0.0
        forward = self.regions.get(source)
        if forward is not None and target in forward.latency_ms:
            return forward.latency_ms[target]
        backward = self.regions.get(target)
        if backward is not None and source in backward.latency_ms:
            return backward.latency_ms[source]
        return float("inf")


def _replica_source_problems(model_name: str, model: GatewayModelConfig) -> list[str]:
    """A model's replicas are listed (static), discovered, or started by the autoscaler; an autoscaled
    model's replicas are registered by `ember up` or discovered (a Deployment the Kubernetes provider scales)."""
    if model.autoscaling is None:
        return [
            f"models.{model_name}.deployments[{index}].replicas: list at least one replica, set discovery, or "
            "give the model an autoscaling section"
            for index, deployment in enumerate(model.deployments)
            if not deployment.replicas and deployment.discovery is None
        ]
    if len(model.deployments) != 1:
        return [
            f"models.{model_name}.deployments: an autoscaled model has exactly one deployment, its replicas join it"
        ]
    if model.deployments[0].replicas:
        return [
            f"models.{model_name}.deployments[0].replicas: must be empty for an autoscaled model "
            "(the autoscaler starts and registers its replicas)"
        ]
    return []


def format_location(loc: tuple[str | int, ...]) -> str:
    """('models', 'tiny', 'deployments', 0, 'weight') -> 'models.tiny.deployments[0].weight'."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part in ("model_validator", "function-after") or part.startswith("function-"):
            continue
        else:
            text += f".{part}" if text else str(part)
    return text


def validation_message(source: str, error: ValidationError) -> str:
    problems = []
    for item in error.errors():
        message = item["msg"].removeprefix("Value error, ")
        location = format_location(item["loc"])
        problems.append(f"{location}: {message}" if location else message)
    return f"{source}: " + "; ".join(problems)


def parse_config(data: Any, source: str = "gateway config", base_dir: Path | None = None) -> GatewayConfig:
    """Validate an already-parsed mapping (tests build configs this way)."""
    if not isinstance(data, dict):
        raise GatewayConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    try:
        config = GatewayConfig.model_validate(data)
    except ValidationError as exc:
        raise GatewayConfigError(validation_message(source, exc)) from None
    store = config.keys.store
    if store is not None and base_dir is not None and not store.is_absolute():
        config = config.model_copy(
            update={"keys": config.keys.model_copy(update={"store": (base_dir / store).resolve()})}
        )
    config._base_dir = base_dir
    return config


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise GatewayConfigError(f"cannot read gateway config {path}: {exc.strerror or exc}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise GatewayConfigError(f"{path}: not valid YAML: {exc}") from None


def merge_mappings(base: dict[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `overlay`'s keys set; nested mappings are merged key by key, anything else replaced."""
    merged = dict(base)
    for key, value in overlay.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = merge_mappings(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(path: str | Path, overlays: Sequence[str | Path] = ()) -> GatewayConfig:
    """The config file, with each overlay file merged over it in order (on Kubernetes the keys and admin
    digest come from a Secret, the rest from a ConfigMap)."""
    path = Path(path)
    data = _read_yaml(path)
    for overlay_path in map(Path, overlays):
        overlay = _read_yaml(overlay_path)
        if not isinstance(data, dict) or not isinstance(overlay, dict):
            raise GatewayConfigError(
                f"{overlay_path}: an overlay and the config it extends must both be mappings"
            )
        data = merge_mappings(data, overlay)
    source = " + ".join(map(str, [path, *overlays]))
    return parse_config(data, source=source, base_dir=path.parent)


def with_replica_api_keys(config: GatewayConfig, api_keys: Mapping[str, str]) -> GatewayConfig:
    """`config` with the replicas named by id in `api_keys` carrying those keys (in place of any they
    had): how `ember up`'s gateway learns the service credential of the replicas it launched."""
    known = {
        replica.replica_id
        for model in config.models.values()
        for d in model.deployments
        for replica in d.replicas
    }
    unknown = sorted(set(api_keys) - known)
    if unknown:
        raise GatewayConfigError(f"no replica under models has the id(s): {', '.join(unknown)}")

    def keyed(replica: ReplicaConfig) -> ReplicaConfig:
        if replica.replica_id not in api_keys:
            return replica
        return replica.model_copy(update={"api_key": api_keys[replica.replica_id], "api_key_env": None})

    models = {
        name: model.model_copy(update={"deployments": [
            deployment.model_copy(update={"replicas": [keyed(replica) for replica in deployment.replicas]})
            for deployment in model.deployments
        ]})
        for name, model in config.models.items()
    }  # fmt: skip
    return config.model_copy(update={"models": models})
