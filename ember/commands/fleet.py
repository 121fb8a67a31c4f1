"""`ember fleet status [fleet.yaml]`: the replicas and last scaling decisions of a running `ember up`."""

from __future__ import annotations

import argparse

from ember.errors import EmberError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("fleet", help="Inspect a fleet started by `ember up`")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    status = actions.add_parser(
        "status",
        help="Autoscaled models: replicas by state and the last scaling decisions",
        description="Ask a running `ember up` (its launch.autoscaler.port) for its autoscaled models' replicas "
        "and the autoscaler's last decisions.",
    )
    status.add_argument("fleet", nargs="?", default=None, help="The fleet file `ember up` runs (default: the packaged one)")
    status.add_argument("--decisions", type=int, default=20, help="How many of the last decisions to show (default 20)")
    status.add_argument("--json", action="store_true", help="Print the raw status document")
    status.set_defaults(func=run_status)


def run_status(args: argparse.Namespace) -> int:
    import json

    import httpx

    from ember.commands.up import default_fleet_path
    from ember.control.fleet import load_fleet

    fleet = load_fleet(args.fleet or default_fleet_path())
    settings = fleet.launch.autoscaler
    if not fleet.autoscaled:
        raise EmberError(f"{fleet.path}: no model has an autoscaling section")
    if settings.port is None:
        raise EmberError(f"{fleet.path}: set launch.autoscaler.port so that `ember up` serves its status")
    url = f"http://{settings.host}:{settings.port}/status"
    try:
        status = httpx.get(url, timeout=5.0).json()
    except (httpx.HTTPError, ValueError) as exc:
        raise EmberError(f"no `ember up` answers on {url}: {exc}") from None
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    for name, model in status["models"].items():
        states = [replica["state"] for replica in model["replicas"]]
        counts = ", ".join(f"{states.count(state)} {state}" for state in ("ready", "loading", "draining"))
        print(f"{name}: desired {model['desired']} (min {model['min_replicas']}, max {model['max_replicas']}); {counts}")
        for replica in model["replicas"]:
            cold = "" if replica["cold_start_s"] is None else f", cold start {replica['cold_start_s']:.1f}s"
            print(f"  {replica['id']:<24} {replica['state']:<9} {replica['url']}{cold}")
    decisions = status["decisions"][-args.decisions :] if args.decisions > 0 else []
    if decisions:
        print("last decisions:")
    for entry in decisions:
        print(f"  {entry['time']}  {entry['model']}: {entry['current']} -> {entry['desired']}  {entry['reason']}  {entry['detail']}")
    return 0
