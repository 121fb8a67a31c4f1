"""`ember deploy k8s fleet.yaml -o DIR`: the fleet file as Kubernetes manifests (ember.deploy.kubernetes)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("deploy", help="Render a fleet file for a cluster (Kubernetes manifests)")
    targets = parser.add_subparsers(dest="target", metavar="TARGET", required=True)
    k8s = targets.add_parser(
        "k8s",
        help="Kubernetes manifests: replicas, gateway, Secrets, RBAC, PodDisruptionBudgets, ServiceMonitor",
        description="Render the fleet file (its models, keys and launch.kubernetes section) as plain Kubernetes "
        "manifests for `kubectl apply -f DIR`. The fleet's service credential is generated anew on each run.",
    )
    k8s.add_argument("fleet", nargs="?", default=None, help="Fleet YAML file (default: the packaged fleet)")
    k8s.add_argument("-o", "--output", required=True, help="Folder to write the manifests into (created if missing)")
    k8s.set_defaults(func=run_k8s)


def run_k8s(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ember.commands.up import default_fleet_path
    from ember.control.fleet import load_fleet
    from ember.deploy.kubernetes import render, write_manifests

    fleet = load_fleet(args.fleet or default_fleet_path())
    for path in write_manifests(render(fleet), Path(args.output)):
        print(path)
    return 0
