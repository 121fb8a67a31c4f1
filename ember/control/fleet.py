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
        tiny: {model: ./tiny-model, args: [--dtype, float32], capacity: 8, region: local}
      autoscaler: {interval_s: 2, port: 8090} # decision interval; /metrics and /status of `ember up` (optional)

Each launched replica serves, as `--served-model-name`, the model ids its deployments send upstream,
so the gateway's requests always name a model the replica knows.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ember.errors import EmberError
from ember.gateway.config import (
    AutoscalingConfig,
    GatewayConfig,
    GatewayConfigError,
    format_location,
    load_config,
)
from ember.gateway.replicas import ReplicaPool
from ember.gateway.router import Router

LOCAL_HOSTS = ("127.0.0.1", "localhost")


class FleetError(EmberError):
    """The fleet file's `launch:` section is missing or does not fit its `models:`."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LaunchGateway(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    args: list[str] = Field(default_factory=list, description="More `ember gateway` flags")


class LaunchReplica(_Strict):
    port: int = Field(ge=1, le=65535, description="Port of a replica url in `models:` on this machine")
    model: str | None = Field(default=None, description="What `ember serve --model` loads")
    args: list[str] = Field(default_factory=list, description="More `ember serve` flags")


class RestartPolicy(_Strict):
    initial_backoff_s: float = Field(default=1.0, gt=0)
    max_backoff_s: float = Field(default=30.0, gt=0)
    stable_after_s: float = Field(default=30.0, gt=0, description="Uptime after which the backoff resets")

    @model_validator(mode="after")
    def _ordered(self) -> RestartPolicy:
        if self.max_backoff_s < self.initial_backoff_s:
            raise ValueError(f"max_backoff_s ({self.max_backoff_s}) is below initial_backoff_s ({self.initial_backoff_s})")
        return self


class LaunchAutoscaled(_Strict):
    model: str | None = Field(default=None, description="What `ember serve --model` loads; default: the model id")
    args: list[str] = Field(default_factory=list, description="More `ember serve` flags")
    host: str = "127.0.0.1"
    capacity: int = Field(default=16, gt=0, description="Max concurrent requests the gateway sends each replica")
    region: str | None = None


class LaunchAutoscaler(_Strict):
    interval_s: float = Field(default=2.0, gt=0, description="Time between two scaling decisions")
    host: str = "127.0.0.1"
    port: int | None = Field(default=None, ge=1, le=65535, description="Serves /metrics and /status when set")


class LaunchConfig(_Strict):
    gateway: LaunchGateway = Field(default_factory=LaunchGateway)
    replicas: list[LaunchReplica] = Field(default_factory=list)
    restart: RestartPolicy = Field(default_factory=RestartPolicy)
    shutdown_timeout_s: float = Field(default=30.0, gt=0, description="Per child, before SIGKILL")
    autoscaled: dict[str, LaunchAutoscaled] = Field(default_factory=dict)
    autoscaler: LaunchAutoscaler = Field(default_factory=LaunchAutoscaler)


@dataclass(frozen=True)
class AutoscaledModel:
    """What the local provider needs to start one more replica of an autoscaled model."""

    name: str  # the model name clients use
    autoscaling: AutoscalingConfig
    serve_args: list[str]  # `ember <serve_args>` without --host/--port, which each replica gets its own of
    host: str
    capacity: int
    region: str | None


@dataclass(frozen=True)
class ChildSpec:
    name: str  # "gateway", "replica-8001": the prefix of its log lines
    argv: list[str]
    health_url: str  # polled only to report readiness; the gateway probes replicas itself
    env: dict[str, str] = field(default_factory=dict)  # on top of ember up's own environment


@dataclass(frozen=True)
class Fleet:
    path: Path
    gateway: GatewayConfig
    launch: LaunchConfig
    children: list[ChildSpec]  # the gateway first: it is stopped first on shutdown
    autoscaled: dict[str, AutoscaledModel] = field(default_factory=dict)  # by the model name clients use

    @property
    def gateway_url(self) -> str:
        return f"http://{self.launch.gateway.host}:{self.launch.gateway.port}"


def load_fleet(path: str | Path) -> Fleet:
    path = Path(path)
    gateway = load_config(path)  # the gateway's own validation, exactly as `ember gateway` will do it
    try:  # routing options are checked when the gateway builds its router: check them now, not in a crash loop
        Router(gateway, ReplicaPool.from_config(gateway))
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
    gateway_argv = [*python, "gateway", "--config", str(path.resolve()), "--host", launch.gateway.host,
                    "--port", str(launch.gateway.port), *launch.gateway.args]  # fmt: skip
    children = [ChildSpec("gateway", gateway_argv, f"http://{launch.gateway.host}:{launch.gateway.port}/health")]
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
        host, served = _served_models(gateway, replica.port)
        if not served:
            raise FleetError(
                f"{where}.port: no replica under models has a local url on port {replica.port} "
                f"(e.g. http://127.0.0.1:{replica.port})"
            )
        model = replica.model or served[0]
        if replica.model is None and len(served) > 1:
            raise FleetError(f"{where}.model: required, its deployments serve several models: {', '.join(served)}")
        if not Path(model).is_absolute() and (path.parent / model).exists():
            model = str((path.parent / model).resolve())
        argv = [*python, "serve", "--model", model, "--host", host, "--port", str(replica.port),
                "--served-model-name", *served]  # fmt: skip
        if "--num-threads" not in replica.args:
            argv += ["--num-threads", str(threads)]
        children.append(ChildSpec(f"replica-{replica.port}", [*argv, *replica.args], f"http://{host}:{replica.port}/health"))
    return Fleet(path, gateway, launch, children, _autoscaled_models(path, gateway, launch, threads))


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
        if how.region is not None and gateway.regions and how.region not in gateway.regions:
            raise FleetError(f"{path}: launch.autoscaled.{name}.region: {how.region!r} is not declared under regions")
        upstream = model.deployments[0].model or name
        source = how.model or upstream
        if not Path(source).is_absolute() and (path.parent / source).exists():
            source = str((path.parent / source).resolve())
        serve_args = ["serve", "--model", source, "--served-model-name", upstream]
        if "--num-threads" not in how.args:
            serve_args += ["--num-threads", str(threads_per_replica)]
        models[name] = AutoscaledModel(
            name, model.autoscaling, [*serve_args, *how.args], how.host, how.capacity, how.region
        )
    return models


def _served_models(gateway: GatewayConfig, port: int) -> tuple[str, list[str]]:
    """(host, model ids) of the replicas under `models:` listening locally on `port`."""
    host = "127.0.0.1"
    served: list[str] = []
    for name, model in gateway.models.items():
        for deployment in model.deployments:
            for replica in deployment.replicas:
                url = urlsplit(replica.url)
                if url.hostname in LOCAL_HOSTS and (url.port or (443 if url.scheme == "https" else 80)) == port:
                    host = url.hostname
                    upstream = deployment.model or name
                    if upstream not in served:
                        served.append(upstream)
    return host, served
