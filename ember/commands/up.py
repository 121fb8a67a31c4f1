"""`ember up [fleet.yaml]`: the gateway and its local `ember serve` replicas, supervised, in one command."""

from __future__ import annotations

import argparse
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ember.control.fleet import Fleet

DEMOS = ("default", "multi-cluster")  # the fleet files packaged in ember/fleets/


def default_fleet_path(demo: str = "default") -> str:
    return str(resources.files("ember.fleets").joinpath(f"{demo}.yaml"))


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "up",
        help="Start a gateway and its local replicas from one fleet file, restarting any that crash",
        description="Start the gateway and the local `ember serve` replicas a fleet file describes (the gateway "
        "config plus a `launch:` section), restart crashed ones with backoff, stop all on SIGTERM or Ctrl-C.",
    )
    parser.add_argument(
        "fleet",
        nargs="?",
        default=None,
        help="Fleet YAML file (default: the packaged fleet, SmolLM2 on two replicas, gateway on 127.0.0.1:8000)",
    )
    parser.add_argument(
        "--demo",
        choices=DEMOS,
        default=None,
        help="Start a packaged fleet instead of a file: multi-cluster is 2 clusters x (2 gateways sharing "
        "PostgreSQL and Redis + 2 SmolLM2 replicas) in 2 regions behind a front door on 127.0.0.1:8000",
    )
    parser.add_argument(
        "--postgres-dsn",
        default=None,
        help="PostgreSQL of a multi-cluster fleet's clusters (default: $EMBER_POSTGRES_DSN, else "
        "postgresql://postgres@127.0.0.1:5432/postgres)",
    )
    parser.add_argument(
        "--redis-url",
        default=None,
        help="Redis of a multi-cluster fleet's clusters (default: $EMBER_REDIS_URL, else redis://127.0.0.1:6379/0)",
    )
    parser.add_argument(
        "--print-commands",
        action="store_true",
        help="Validate the fleet file and print the command of each process instead of starting them",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os
    import shutil
    import tempfile

    from ember.control import multi_cluster
    from ember.control.fleet import FleetError, load_fleet

    if args.fleet is not None and args.demo is not None:
        raise FleetError("give a fleet file or --demo, not both")
    path = args.fleet or default_fleet_path(args.demo or "default")
    if not multi_cluster.is_multi_cluster_file(path):
        if args.postgres_dsn or args.redis_url:
            raise FleetError(
                "--postgres-dsn and --redis-url are for multi-cluster fleets (their `state:` is generated)"
            )
        return _start(load_fleet(path), args.print_commands)  # a bad file fails here, before anything starts
    # The clusters' and the front door's gateway files are generated into a private folder, removed on exit.
    run_dir = tempfile.mkdtemp(prefix="ember-up-")
    try:
        fleet = multi_cluster.load_multi_cluster(
            path,
            Path(run_dir),
            args.postgres_dsn
            or os.environ.get(multi_cluster.POSTGRES_DSN_ENV)
            or multi_cluster.DEFAULT_POSTGRES_DSN,
            args.redis_url or os.environ.get(multi_cluster.REDIS_URL_ENV) or multi_cluster.DEFAULT_REDIS_URL,
        )
        return _start(fleet, args.print_commands)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _start(fleet: Fleet, print_commands: bool) -> int:
    import asyncio
    import shlex
    import sys

    if print_commands:
        for child in fleet.children:
            print(f"{child.name}: {shlex.join(child.argv)}")
        ray = fleet.launch.ray
        for name, model in fleet.autoscaled.items():
            scaling = model.autoscaling
            command = shlex.join([sys.executable, "-m", "ember.cli", *model.serve_args])
            where = f"--host {model.host} --port <a free port>"
            if ray is not None:
                where = (f"--host <its node> --port <a free port>  (a Ray actor, address {ray.address}, "
                         f"num_cpus {ray.replica.num_cpus:g}, num_gpus {ray.replica.num_gpus:g})")  # fmt: skip
            print(
                f"{name} (autoscaled, {scaling.min_replicas}..{scaling.max_replicas} replicas): {command} {where}"
            )
        return 0
    return asyncio.run(run_fleet(fleet))


async def run_fleet(fleet) -> int:
    """The supervisor, and with autoscaled models the autoscaler and its provider: local processes, or
    Ray actors when the fleet has `launch.ray`."""
    import dataclasses
    import secrets

    from ember.control.supervisor import Supervisor

    if not fleet.autoscaled:
        return await Supervisor(fleet).run()
    from ember.control.autoscaling.autoscaler import Autoscaler
    from ember.control.autoscaling.provider import GatewayAdmin, LocalProcessProvider
    from ember.gateway.admin import CONTROL_TOKEN_ENV

    # A token only this gateway and this process know, for registering the replicas it starts.
    token = secrets.token_urlsafe(32)
    gateway, *replicas = fleet.children
    fleet = dataclasses.replace(
        fleet,
        children=[dataclasses.replace(gateway, env={**gateway.env, CONTROL_TOKEN_ENV: token}), *replicas],
    )
    supervisor = Supervisor(fleet)
    admin = GatewayAdmin(fleet.gateway_url, token, drain_timeout_s=fleet.launch.shutdown_timeout_s)
    if fleet.launch.ray is not None:
        from ember.control.autoscaling.ray_provider import RayProvider

        provider = await RayProvider.connect(fleet, admin, log=supervisor.log)
    else:
        provider = LocalProcessProvider(
            supervisor, fleet.autoscaled, admin, log=supervisor.log, credential=fleet.credential
        )
    supervisor.services.append(Autoscaler(fleet, provider, admin, log=supervisor.log))
    return await supervisor.run()
