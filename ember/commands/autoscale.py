"""`ember autoscale fleet.yaml`: the autoscaler alone, against a fleet `ember deploy k8s` put on a cluster.

It reads the gateway's /metrics (launch.kubernetes.autoscaler.gateway_url, by default the rendered
gateway Service) and scales each autoscaled model's Deployment through its scale subresource
(ember.control.autoscaling.kubernetes_provider); it starts no local process.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ember.control.fleet import Fleet


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "autoscale",
        help="Autoscale a fleet deployed to Kubernetes (scales its Deployments; starts no local process)",
        description="Run the autoscaler of a fleet file against a Kubernetes cluster where `ember deploy k8s` "
        "rendered it: read the gateway's /metrics, scale each autoscaled model's Deployment through its scale "
        "subresource, and have the gateway drain a pod before the Deployment shrinks. The gateway's admin calls "
        "use the token in $EMBER_GATEWAY_CONTROL_TOKEN (the gateway's control token or its admin key). "
        "Stops on SIGTERM or Ctrl-C.",
    )
    parser.add_argument("fleet", nargs="?", default=None, help="Fleet YAML file (default: the packaged fleet)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ember.commands.up import default_fleet_path
    from ember.control.fleet import load_fleet

    fleet = load_fleet(args.fleet or default_fleet_path())  # a bad file fails here, before anything starts
    return asyncio.run(autoscale(fleet))


def gateway_url(fleet: Fleet) -> str:
    """launch.kubernetes.autoscaler.gateway_url, else the gateway Service `ember deploy k8s` renders."""
    from ember.deploy.kubernetes import GATEWAY_NAME, HTTP_PORT
    from ember.deploy.settings import KubernetesLaunch

    settings = fleet.launch.kubernetes or KubernetesLaunch()
    return settings.autoscaler.gateway_url or f"http://{GATEWAY_NAME}.{settings.namespace}.svc:{HTTP_PORT}"


async def autoscale(fleet: Fleet, stop: asyncio.Event | None = None) -> int:
    """Runs until SIGTERM/SIGINT, or until `stop` is set (how the tests end it)."""
    import os
    import signal

    from ember.control.autoscaling.autoscaler import Autoscaler
    from ember.control.autoscaling.kubernetes_provider import KubernetesProvider, fleet_targets
    from ember.control.autoscaling.provider import GatewayAdmin
    from ember.control.fleet import FleetError
    from ember.deploy.settings import KubernetesLaunch
    from ember.gateway.config import CONTROL_TOKEN_ENV
    from ember.kube_client import api_client

    if not fleet.autoscaled:
        raise FleetError(f"{fleet.path}: no model has an autoscaling section: nothing to autoscale")
    token = os.environ.get(CONTROL_TOKEN_ENV)
    if not token:
        raise FleetError(f"set {CONTROL_TOKEN_ENV} to the gateway's control token or admin key (its drain calls need it)")
    settings = fleet.launch.kubernetes or KubernetesLaunch()
    targets = fleet_targets(fleet)
    url = gateway_url(fleet)
    admin = GatewayAdmin(url, token, drain_timeout_s=fleet.launch.shutdown_timeout_s)
    provider = KubernetesProvider(targets, admin, api_client(settings.autoscaler.kubeconfig))
    autoscaler = Autoscaler(fleet, provider, admin, gateway_url=url)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await autoscaler.start()
        for model, target in targets.items():
            print(f"autoscale: {model}: Deployment {target.namespace}/{target.deployment}, gateway {url}", flush=True)
        await stop.wait()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        await autoscaler.stop()
    return 0
