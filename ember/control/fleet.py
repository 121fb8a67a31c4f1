"""The fleet file of `ember up`: a gateway config (ember.gateway.config, validated by the gateway's
own schema) plus a `launch:` section saying which of its replicas to start locally and how.

    launch:
      gateway: {host: 127.0.0.1, port: 8000, args: []}
      replicas:
        - port: 8001                          # the replica in `models:` whose url is http://127.0.0.1:8001
          model: smollm2-135m-instruct        # what `ember serve --model` loads; default: the deployment's model id
          args: [--dtype, float32]            # more `ember serve` flags
      restart: {initial_backoff_s: 1, max_backoff_s: 30, stable_after_s: 30}
      shutdown_timeout_s: 30
      autoscaled:                             # how to start replicas of models with an `autoscaling:` section
        tiny: {model: ./tiny-model, args: [--dtype, float32], capacity: 8, region: local}  # or profile: p.json
      autoscaler: {interval_s: 2, port: 8090} # decision interval; /metrics and /status of `ember up` (optional)
      ray:                                    # optional: the autoscaled replicas run as Ray actors (docs/ray.md)
        address: local                        # or auto, ray://head:10001, head:6379
        replica: {num_cpus: 1, num_gpus: 0}
      kubernetes: {...}                       # `ember deploy k8s` and `ember autoscale` (ember.deploy.settings)

Each launched replica serves, as `--served-model-name`, the model ids its deployments send upstream,
so the gateway's requests always name a model the replica knows.

Each `ember up` generates a service credential that only its gateway holds: the replicas it launches
get it as their API key and the gateway sends it to them (both through the environment, which `ps`
does not show), so no other local process can call a replica past the gateway's keys and limits.
"""

from __future__ import annotations

import math
import os
import re
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, model_validator

from ember.control.autoscaling.replica_profile import ReplicaProfile
from ember.deploy.settings import KubernetesLaunch
from ember.errors import EmberError
from ember.gateway.config import (
    FLEET_CREDENTIAL_ENV,
    AutoscalingConfig,
    GatewayConfig,
    GatewayConfigError,
    format_location,
    load_config,
)
from ember.gateway.routing import validate_routing
from ember.server.settings import API_KEY_ENV
from ember.strict_model import StrictModel

LOCAL_HOSTS = ("127.0.0.1", "localhost")


class FleetError(EmberError):
    """The fleet file's `launch:` section is missing or does not fit its `models:`."""


class LaunchGateway(StrictModel):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    args: list[str] = Field(default_factory=list, description="More `ember gateway` flags")


class LaunchReplica(StrictModel):
    port: int = Field(ge=1, le=65535, description="Port of a replica url in `models:` on this machine")
    model: str | None = Field(default=None, description="What `ember serve --model` loads")
    args: list[str] = Field(default_factory=list, description="More `ember serve` flags")


class RestartPolicy(StrictModel):
    initial_backoff_s: float = Field(default=1.0, gt=0)
    max_backoff_s: float = Field(default=30.0, gt=0)
    stable_after_s: float = Field(default=30.0, gt=0, description="Uptime after which the backoff resets")

    @model_validator(mode="after")
    def _ordered(self) -> RestartPolicy:
        if self.max_backoff_s < self.initial_backoff_s:
            raise ValueError(f"max_backoff_s ({self.max_backoff_s}) is below initial_backoff_s ({self.initial_backoff_s})")
        return self


class LaunchAutoscaled(StrictModel):
    model: str | None = Field(default=None, description="What `ember serve --model` loads; default: the model id")
    args: list[str] = Field(default_factory=list, description="More `ember serve` flags")
    host: str = "127.0.0.1"
    capacity: int = Field(default=16, gt=0, description="Max concurrent requests the gateway sends each replica")
    profile: str | None = Field(
        default=None, description="An `ember profile` file (relative to the fleet file): its max_batch is the "
        "capacity unless capacity is given; the policy projects one replica fewer by its step-time model",
    )  # fmt: skip
    region: str | None = None


class LaunchAutoscaler(StrictModel):
    interval_s: float = Field(default=2.0, gt=0, description="Time between two scaling decisions")
    host: str = "127.0.0.1"
    port: int | None = Field(default=None, ge=1, le=65535, description="Serves /metrics and /status when set")


class RayHead(StrictModel):
    """The Ray head `ember up` starts itself with `address: local`."""

    num_cpus: int | None = Field(default=None, gt=0, description="CPUs it offers; default: the machine's")
    num_gpus: int | None = Field(default=None, ge=0, description="GPUs it offers; default: the machine's")
    object_store_memory_mb: int = Field(default=200, ge=80, description="Its object store (replicas use little)")


class RayReplicaRequest(StrictModel):
    """What Ray reserves on a node for each replica; it places the replica where that is free."""

    num_cpus: float = Field(default=1.0, ge=0, description="Also the replica's --num-threads (rounded up)")
    num_gpus: float = Field(default=0.0, ge=0)
    memory_mb: int | None = Field(default=None, gt=0, description="Memory Ray reserves for it (a scheduling hint)")


class LaunchRay(StrictModel):
    address: str = Field(
        default="auto",
        description='"local" (start a Ray head in `ember up`), "auto" (the cluster this node belongs to), '
        '"ray://host:10001" (Ray Client) or "host:6379" (a head\'s GCS)',
    )
    namespace: str = Field(default="ember", min_length=1, description="Ray namespace of the replica actors")
    head: RayHead = Field(default_factory=RayHead)
    replica: RayReplicaRequest = Field(default_factory=RayReplicaRequest)
    health_interval_s: float = Field(default=1.0, gt=0, description="How often each replica's process is checked")

    @model_validator(mode="after")
    def _address(self) -> LaunchRay:
        address = self.address
        if address not in ("local", "auto") and not re.fullmatch(r"(ray://)?[^\s/:]+:\d{1,5}", address):
            raise ValueError(f'address must be "local", "auto", ray://host:port or host:port, got {address!r}')
        if address != "local" and "head" in self.model_fields_set:
            raise ValueError('head: only for address "local" (the head `ember up` starts itself)')
        return self


class LaunchConfig(StrictModel):
    gateway: LaunchGateway = Field(default_factory=LaunchGateway)
    replicas: list[LaunchReplica] = Field(default_factory=list)
    restart: RestartPolicy = Field(default_factory=RestartPolicy)
    shutdown_timeout_s: float = Field(default=30.0, gt=0, description="Per child, before SIGKILL")
    autoscaled: dict[str, LaunchAutoscaled] = Field(default_factory=dict)
    autoscaler: LaunchAutoscaler = Field(default_factory=LaunchAutoscaler)
    ray: LaunchRay | None = Field(default=None, description="Run the autoscaled models' replicas as Ray actors")
    kubernetes: KubernetesLaunch | None = None  # `ember deploy k8s` and `ember autoscale`


@dataclass(frozen=True)
class AutoscaledModel:
    """What the local provider needs to start one more replica of an autoscaled model."""

    name: str  # the model name clients use
    autoscaling: AutoscalingConfig
    serve_args: list[str]  # `ember <serve_args>` without --host/--port, which each replica gets its own of
    host: str
    capacity: int
    region: str | None
    profile: ReplicaProfile | None = None  # launch.autoscaled.<model>.profile, for the policy's N-1 projection


@dataclass(frozen=True)
class ChildSpec:
    name: str  # "gateway", "replica-8001": the prefix of its log lines
    argv: list[str]
    health_url: str  # polled only to report readiness; the gateway probes replicas itself
    env: Mapping[str, str] = field(default_factory=dict, repr=False)  # added to the supervisor's environment


@dataclass(frozen=True)
class Fleet:
    path: Path
    gateway: GatewayConfig
    launch: LaunchConfig
    children: list[ChildSpec]  # the gateway first: it is stopped first on shutdown
    autoscaled: dict[str, AutoscaledModel] = field(default_factory=dict)
    # The service credential only the gateway holds; every replica the fleet starts requires it.
    credential: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)

    @property
    def gateway_url(self) -> str:
        return f"http://{self.launch.gateway.host}:{self.launch.gateway.port}"


def load_fleet(path: str | Path) -> Fleet:
    path = Path(path)
    gateway = load_config(path)  # the gateway's own validation, exactly as `ember gateway` will do it
    try:  # the gateway checks routing options when it starts: check them now, not in a crash loop
        validate_routing(gateway)
    except GatewayConfigError as exc:
        raise FleetError(f"{path}: {exc}") from None
    try:
        launch = LaunchConfig.model_validate(gateway.launch or {})
    except ValidationError as exc:
        problems = [
            f"launch.{format_location(item['loc'])}: {item['msg'].removeprefix('Value error, ')}" for item in exc.errors()
        ]
        raise FleetError(f"{path}: " + "; ".join(problems)) from None
    python = [sys.executable, "-m", "ember.cli"]
    credential = secrets.token_urlsafe(32)
    children: list[ChildSpec] = []
    launched_ids: list[str] = []
    used_ports = {launch.gateway.port: "launch.gateway.port"}
    # Threads per replica: the machine's cores shared out among every replica that may run at once,
    # unless the fleet sets --num-threads.
    autoscaled_max = sum(model.autoscaling.max_replicas for model in gateway.models.values() if model.autoscaling)
    threads = max(1, (os.cpu_count() or 1) // max(1, len(launch.replicas) + autoscaled_max))
    for index, replica in enumerate(launch.replicas):
        where = f"{path}: launch.replicas[{index}]"
        if replica.port in used_ports:
            raise FleetError(f"{where}.port: {replica.port} is already used by {used_ports[replica.port]}")
        used_ports[replica.port] = f"launch.replicas[{index}].port"
        host, served, replica_ids, keyed = _local_replicas(gateway, replica.port)
        if not served:
            raise FleetError(
                f"{where}.port: no replica under models has a local url on port {replica.port} "
                f"(e.g. http://127.0.0.1:{replica.port})"
            )
        model = replica.model or served[0]
        if replica.model is None and len(served) > 1:
            raise FleetError(f"{where}.model: required, its deployments serve several models: {', '.join(served)}")
        if keyed:
            raise FleetError(f"{where}: `ember up` generates the key of the replicas it starts; remove {keyed}")
        if any(arg == "--api-key" or arg.startswith("--api-key=") for arg in replica.args):
            raise FleetError(f"{where}.args: `ember up` generates the key of the replicas it starts; remove --api-key")
        if not Path(model).is_absolute() and (path.parent / model).exists():
            model = str((path.parent / model).resolve())
        argv = [*python, "serve", "--model", model, "--host", host, "--port", str(replica.port),
                "--served-model-name", *served]  # fmt: skip
        if "--num-threads" not in replica.args:
            argv += ["--num-threads", str(threads)]
        children.append(
            ChildSpec(
                f"replica-{replica.port}", [*argv, *replica.args], f"http://{host}:{replica.port}/health",
                env={API_KEY_ENV: credential},
            )
        )  # fmt: skip
        launched_ids += replica_ids
    gateway_argv = [*python, "gateway", "--config", str(path.resolve()), "--host", launch.gateway.host,
                    "--port", str(launch.gateway.port)]  # fmt: skip
    if launched_ids:
        gateway_argv += ["--fleet-replicas", *launched_ids]
    gateway_child = ChildSpec(
        "gateway", [*gateway_argv, *launch.gateway.args], f"http://{launch.gateway.host}:{launch.gateway.port}/health",
        env={FLEET_CREDENTIAL_ENV: credential},
    )  # fmt: skip
    if launch.ray is not None:
        if not any(model.autoscaling for model in gateway.models.values()):
            raise FleetError(f"{path}: launch.ray: Ray runs the replicas of models with an autoscaling section; none has one")
        threads = max(1, math.ceil(launch.ray.replica.num_cpus))  # what Ray grants each replica
    autoscaled = _autoscaled_models(path, gateway, launch, threads)
    return Fleet(path, gateway, launch, [gateway_child, *children], autoscaled, credential)


def _autoscaled_models(
    path: Path, gateway: GatewayConfig, launch: LaunchConfig, threads_per_replica: int
) -> dict[str, AutoscaledModel]:
    for name in launch.autoscaled:
        model = gateway.models.get(name)
        if model is None or model.autoscaling is None:
            raise FleetError(f"{path}: launch.autoscaled.{name}: names no model with an autoscaling section")
    models: dict[str, AutoscaledModel] = {}
    for name, model in gateway.models.items():
        if model.autoscaling is None:
            continue
        how = launch.autoscaled.get(name) or LaunchAutoscaled()
        if launch.ray is not None and "host" in how.model_fields_set:
            raise FleetError(f"{path}: launch.autoscaled.{name}.host: replicas on Ray listen on their node's address")
        if how.region is not None and gateway.regions and how.region not in gateway.regions:
            raise FleetError(f"{path}: launch.autoscaled.{name}.region: {how.region!r} is not declared under regions")
        upstream = model.deployments[0].model or name
        source = how.model or upstream
        if not Path(source).is_absolute() and (path.parent / source).exists():
            source = str((path.parent / source).resolve())
        serve_args = ["serve", "--model", source, "--served-model-name", upstream]
        if "--num-threads" not in how.args:
            serve_args += ["--num-threads", str(threads_per_replica)]
        capacity, profile = how.capacity, None
        if how.profile is not None:
            profile = _read_profile(path.parent / how.profile, f"{path}: launch.autoscaled.{name}.profile")
            if "capacity" not in how.model_fields_set:
                capacity = profile.max_batch
        models[name] = AutoscaledModel(
            name, model.autoscaling, [*serve_args, *how.args], how.host, capacity, how.region, profile
        )
    return models


def _read_profile(path: Path, where: str) -> ReplicaProfile:
    """An `ember profile` file: its max_batch is the default capacity, its step-time model the policy's."""
    try:
        return ReplicaProfile.model_validate_json(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise FleetError(f"{where}: cannot read {path}: {exc.strerror or exc}") from None
    except ValidationError as exc:
        raise FleetError(f"{where}: {path} is not a profile ({exc.error_count()} error(s): {exc.errors()[0]['msg']})") from None


def _local_replicas(gateway: GatewayConfig, port: int) -> tuple[str, list[str], list[str], str | None]:
    """The replicas under `models:` listening locally on `port`: (host, the model ids they serve, their
    replica ids, where one already configures an api key, if any does)."""
    host = "127.0.0.1"
    served: list[str] = []
    replica_ids: list[str] = []
    keyed = None
    for name, model in gateway.models.items():
        for d_index, deployment in enumerate(model.deployments):
            for r_index, replica in enumerate(deployment.replicas):
                url = urlsplit(replica.url)
                if url.hostname in LOCAL_HOSTS and (url.port or (443 if url.scheme == "https" else 80)) == port:
                    host = url.hostname
                    replica_ids.append(replica.replica_id)
                    upstream = deployment.model or name
                    if upstream not in served:
                        served.append(upstream)
                    if deployment.sets_api_key:
                        keyed = f"the api key of models.{name}.deployments[{d_index}]"
                    if replica.sets_api_key:
                        keyed = f"the api key of models.{name}.deployments[{d_index}].replicas[{r_index}]"
    return host, served, replica_ids, keyed
