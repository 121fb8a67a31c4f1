"""`ember up [fleet.yaml]`: the gateway and its local `ember serve` replicas, supervised, in one command."""

from __future__ import annotations

import argparse
from importlib import resources


def default_fleet_path() -> str:
    return str(resources.files("ember.fleets").joinpath("default.yaml"))


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
        "--print-commands",
        action="store_true",
        help="Validate the fleet file and print the command of each process instead of starting them",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import shlex
    import sys

    from ember.control.fleet import load_fleet

    fleet = load_fleet(args.fleet or default_fleet_path())  # a bad file fails here, before anything starts
    if args.print_commands:
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
            print(f"{name} (autoscaled, {scaling.min_replicas}..{scaling.max_replicas} replicas): {command} {where}")
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
    fleet = dataclasses.replace(fleet, children=[dataclasses.replace(gateway, env={**gateway.env, CONTROL_TOKEN_ENV: token}), *replicas])
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
