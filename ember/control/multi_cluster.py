"""A multi-cluster fleet for `ember up`: several clusters (each several gateways sharing PostgreSQL and
Redis, in front of their own local replicas) in several regions, and one front door over them all.

    multi_cluster:
      model: {name: smollm2-135m-instruct, source: smollm2-135m-instruct, args: []}
      regions: {us-east: {latency_ms: {us-west: 70}}, us-west: {}}
      front_door: {host: 127.0.0.1, port: 8000, region: us-east}
      keys: {inline: [...]}                  # the front door's client keys (the gateway file's `keys:`)
      clusters:
        east: {region: us-east, gateways: [8100, 8101], replicas: [8110, 8111], replica_capacity: 8}
        west: {region: us-west, gateways: [8200, 8201], replicas: [8210, 8211]}
      state: {schema_prefix: ember_demo, job_lease_s: 30}
      health: {interval_s: 1, timeout_s: 1, unhealthy_threshold: 2}
      restart: {...}                         # as launch.restart of a fleet file
      shutdown_timeout_s: 30

`load_multi_cluster` writes one ordinary gateway file per cluster (a fleet file of ember.control.fleet,
validated and expanded by `load_fleet`) and one front-door file into a run directory, and returns one
`Fleet` whose children are the front door, then every cluster's gateways and replicas. Cluster `east`
keeps its state in PostgreSQL schema `<schema_prefix>_east` and under Redis prefix `<schema_prefix>-east`.

Credentials, all fresh at each start and passed only through the environment: each cluster's replicas
require a credential only that cluster's gateways hold (as `ember up` does for one gateway), and each
cluster's gateways accept one service key, which only the front door holds (`api_key_env`). The
generated files hold the service keys' SHA-256 digests, never the keys, and the PostgreSQL DSN and Redis
URL are read from the environment too (`dsn_env`, `url_env`): they may carry passwords.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import secrets
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from ember.control.fleet import (
    ChildSpec,
    Fleet,
    FleetError,
    LaunchConfig,
    LaunchGateway,
    RestartPolicy,
    load_fleet,
)
from ember.gateway.config import GatewayConfigError, format_location, load_config
from ember.strict_model import StrictModel

POSTGRES_DSN_ENV = "EMBER_POSTGRES_DSN"
REDIS_URL_ENV = "EMBER_REDIS_URL"
DEFAULT_POSTGRES_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


class DemoModel(StrictModel):
    name: str = Field(min_length=1, description="The model name clients send")
    source: str | None = Field(default=None, description="What `ember serve --model` loads; default: name")
    args: list[str] = Field(default_factory=list, description="More `ember serve` flags for every replica")


class DemoFrontDoor(StrictModel):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    region: str | None = Field(default=None, description="Its listener_region; default: the first cluster's")


class DemoCluster(StrictModel):
    region: str
    gateways: list[int] = Field(min_length=1, description="Ports of the cluster's gateways on 127.0.0.1")
    replicas: list[int] = Field(min_length=1, description="Ports of the cluster's replicas on 127.0.0.1")
    replica_capacity: int = Field(
        default=8, gt=0, description="Concurrent requests a gateway sends each replica"
    )


class DemoState(StrictModel):
    schema_prefix: str = Field(
        default="ember_demo",
        pattern=r"^[a-z_][a-z0-9_]*$",
        description="Cluster NAME's schema: <prefix>_NAME",
    )
    job_lease_s: float = Field(default=30.0, gt=0, description="state.postgres.job_lease_s of every cluster")


class MultiClusterSpec(StrictModel):
    model: DemoModel
    regions: dict[str, Any] = Field(default_factory=dict)
    front_door: DemoFrontDoor = Field(default_factory=DemoFrontDoor)
    keys: dict[str, Any] = Field(default_factory=dict, description="The front door's `keys:` section")
    clusters: dict[str, DemoCluster] = Field(min_length=1)
    state: DemoState = Field(default_factory=DemoState)
    health: dict[str, Any] = Field(default_factory=dict, description="The `health:` section of every gateway")
    restart: RestartPolicy = Field(default_factory=RestartPolicy)
    shutdown_timeout_s: float = Field(default=30.0, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> MultiClusterSpec:
        ports = [self.front_door.port] + [
            p for c in self.clusters.values() for p in [*c.gateways, *c.replicas]
        ]
        repeated = sorted({port for port in ports if ports.count(port) > 1})
        if repeated:
            raise ValueError(f"every port must be used once, repeated: {', '.join(map(str, repeated))}")
        names = [name for name in self.clusters if not re.fullmatch(r"[a-z][a-z0-9]*", name)]
        if names:
            raise ValueError(f"cluster names must be lowercase letters and digits: {', '.join(names)}")
        used = {f"clusters.{name}.region": cluster.region for name, cluster in self.clusters.items()}
        if self.front_door.region is not None:
            used["front_door.region"] = self.front_door.region
        undeclared = [f"{where} {region!r}" for where, region in used.items() if region not in self.regions]
        if self.regions and undeclared:
            raise ValueError(f"regions not declared under regions: {', '.join(undeclared)}")
        return self


def is_multi_cluster_file(path: str | Path) -> bool:
    """Whether a fleet file describes a multi-cluster fleet (a top-level `multi_cluster:`)."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return False  # load_fleet reports it
    return isinstance(data, dict) and "multi_cluster" in data


def load_multi_cluster(path: str | Path, run_dir: Path, postgres_dsn: str, redis_url: str) -> Fleet:
    path = Path(path)
    spec = _read_spec(path)
    state_env = {POSTGRES_DSN_ENV: postgres_dsn, REDIS_URL_ENV: redis_url}
    source = spec.model.source or spec.model.name
    if not Path(source).is_absolute() and (path.parent / source).exists():
        source = str((path.parent / source).resolve())
    # Every replica of every cluster may run at once: share the cores among them.
    replica_count = sum(len(cluster.replicas) for cluster in spec.clusters.values())
    threads = max(1, (os.cpu_count() or 1) // replica_count)
    replica_args = (
        spec.model.args
        if "--num-threads" in spec.model.args
        else [*spec.model.args, "--num-threads", str(threads)]
    )
    cluster_children = []
    members: dict[str, dict[str, Any]] = {}
    door_env: dict[str, str] = {}
    for name, cluster in spec.clusters.items():
        service_key = secrets.token_urlsafe(32)
        key_env = f"EMBER_CLUSTER_{name.upper()}_KEY"
        door_env[key_env] = service_key
        cluster_file = run_dir / f"cluster-{name}.yaml"
        _write_yaml(cluster_file, _cluster_config(spec, name, cluster, service_key, source, replica_args))
        with _environment(state_env), _generated_from(path, f"cluster {name}"):
            fleet = load_fleet(cluster_file)
        gateway, *replicas = fleet.children
        for port in cluster.gateways:
            argv = list(gateway.argv)
            argv[argv.index("--port") + 1] = str(port)
            health = f"http://127.0.0.1:{port}/health"
            env = {**gateway.env, **state_env}
            cluster_children.append(
                dataclasses.replace(
                    gateway, name=f"{name}-gateway-{port}", argv=argv, health_url=health, env=env
                )
            )
            members[f"{name}-{port}"] = {
                "url": f"http://127.0.0.1:{port}",
                "region": cluster.region,
                "capacity": cluster.replica_capacity * len(cluster.replicas),
                "api_key_env": key_env,
            }
        cluster_children += [
            dataclasses.replace(replica, name=f"{name}-{replica.name}") for replica in replicas
        ]
    door_file = run_dir / "front-door.yaml"
    _write_yaml(door_file, _front_door_config(spec, members))
    # The members' api_key_env must be set to validate the file.
    with _environment(door_env), _generated_from(path, "the front door"):
        door_config = load_config(door_file)
    launch = LaunchConfig(
        gateway=LaunchGateway(host=spec.front_door.host, port=spec.front_door.port),
        restart=spec.restart,
        shutdown_timeout_s=spec.shutdown_timeout_s,
    )
    door_argv = [sys.executable, "-m", "ember.cli", "gateway", "--config", str(door_file),
                 "--host", spec.front_door.host, "--port", str(spec.front_door.port)]  # fmt: skip
    door = ChildSpec(
        "front-door", door_argv, f"http://{spec.front_door.host}:{spec.front_door.port}/health", door_env
    )
    return Fleet(path, door_config, launch, [door, *cluster_children])


def _read_spec(path: Path) -> MultiClusterSpec:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise FleetError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise FleetError(f"{path}: not valid YAML: {exc}") from None
    others = sorted(set(data) - {"multi_cluster"})
    if others:  # e.g. a gateway section meant for the generated files: say so rather than ignore it
        raise FleetError(
            f"{path}: a multi-cluster file has only `multi_cluster:`, remove: {', '.join(others)}"
        )
    try:
        return MultiClusterSpec.model_validate(data["multi_cluster"])
    except ValidationError as exc:
        problems = [
            f"{'.'.join(['multi_cluster', *filter(None, [format_location(e['loc'])])])}: "
            f"{e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors()
        ]
        raise FleetError(f"{path}: " + "; ".join(problems)) from None


def _cluster_config(
    spec: MultiClusterSpec,
    name: str,
    cluster: DemoCluster,
    service_key: str,
    source: str,
    replica_args: list[str],
) -> dict[str, Any]:
    """One cluster's fleet file: its model on its replicas, the front door's service key, shared state."""
    schema = f"{spec.state.schema_prefix}_{name}"
    return {
        "listener_region": cluster.region,
        "regions": spec.regions,
        "models": {
            spec.model.name: {
                "deployments": [{"replicas": [
                    {"url": f"http://127.0.0.1:{port}", "id": f"{name}-replica-{port}", "region": cluster.region,
                     "capacity": cluster.replica_capacity}
                    for port in cluster.replicas
                ]}]
            }
        },
        "keys": {"inline": [{"name": "front-door", "sha256": hashlib.sha256(service_key.encode()).hexdigest()}]},
        "health": spec.health,
        "state": {
            "backend": "shared",
            "postgres": {"dsn_env": POSTGRES_DSN_ENV, "schema": schema, "job_lease_s": spec.state.job_lease_s},
            "redis": {"url_env": REDIS_URL_ENV, "key_prefix": schema.replace("_", "-")},
        },
        "launch": {
            "gateway": {"port": cluster.gateways[0]},
            "replicas": [{"port": port, "model": source, "args": replica_args} for port in cluster.replicas],
            "restart": spec.restart.model_dump(),
            "shutdown_timeout_s": spec.shutdown_timeout_s,
        },
    }  # fmt: skip


def _front_door_config(spec: MultiClusterSpec, members: dict[str, dict[str, Any]]) -> dict[str, Any]:
    first_region = next(iter(spec.clusters.values())).region
    return {
        "listener_region": spec.front_door.region or first_region,
        "regions": spec.regions,
        "keys": spec.keys,
        "health": spec.health,
        "clusters": {"models": [spec.model.name], "members": members},
    }


def _write_yaml(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(yaml.safe_dump(dict(data), sort_keys=False), encoding="utf-8")


@contextlib.contextmanager
def _generated_from(path: Path, what: str) -> Iterator[None]:
    """A generated gateway file that does not validate: the error names the file the user wrote (the
    generated one is gone once `ember up` exits)."""
    try:
        yield
    except (FleetError, GatewayConfigError) as exc:
        raise FleetError(f"{path}: the gateway file generated for {what} is invalid: {exc}") from None


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """`values` set in this process's environment while validating files that name them (`*_env`), and
    removed afterwards so that no child inherits them: each child gets only those it needs."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
