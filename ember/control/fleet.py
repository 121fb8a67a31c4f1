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

Each launched replica serves, as `--served-model-name`, the model ids its deployments send upstream,
so the gateway's requests always name a model the replica knows.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, model_validator

from ember.errors import EmberError
from ember.gateway.config import GatewayConfig, GatewayConfigError, format_location, load_config
from ember.gateway.routing import validate_routing
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


class LaunchConfig(StrictModel):
    gateway: LaunchGateway = Field(default_factory=LaunchGateway)
    replicas: list[LaunchReplica] = Field(default_factory=list)
    restart: RestartPolicy = Field(default_factory=RestartPolicy)
    shutdown_timeout_s: float = Field(default=30.0, gt=0, description="Per child, before SIGKILL")


@dataclass(frozen=True)
class ChildSpec:
    name: str  # "gateway", "replica-8001": the prefix of its log lines
    argv: list[str]
    health_url: str  # polled only to report readiness; the gateway probes replicas itself


@dataclass(frozen=True)
class Fleet:
    path: Path
    gateway: GatewayConfig
    launch: LaunchConfig
    children: list[ChildSpec]  # the gateway first: it is stopped first on shutdown

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
    gateway_argv = [*python, "gateway", "--config", str(path.resolve()), "--host", launch.gateway.host,
                    "--port", str(launch.gateway.port), *launch.gateway.args]  # fmt: skip
    children = [ChildSpec("gateway", gateway_argv, f"http://{launch.gateway.host}:{launch.gateway.port}/health")]
    used_ports = {launch.gateway.port: "launch.gateway.port"}
    # Threads per replica: the machine's cores shared out, unless the fleet sets --num-threads.
    threads = max(1, (os.cpu_count() or 1) // max(1, len(launch.replicas)))
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
    return Fleet(path, gateway, launch, children)


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
