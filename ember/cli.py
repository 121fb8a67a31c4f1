"""The one `ember` command line. Each subcommand lives in `ember/commands/<name>.py`
and exposes `register(subparsers)`; this module only wires them together."""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules under ember.commands, in the order `ember --help` lists them.
COMMAND_MODULES = [
    "generate",
    "serve",
    "gateway",
    "up",
    "fleet",
    "deploy",
    "autoscale",
    "simulate",
    "profile",
    "keys",
    "bench",
]
# The pip extra (pyproject.toml) that holds the third-party packages each command imports.
COMMAND_EXTRAS = {
    "generate": "engine",
    "serve": "engine",
    "profile": "engine",
    "gateway": "gateway",
    "up": "gateway",
    "deploy": "gateway",
    "autoscale": "gateway",
    "keys": "gateway",
    "bench": "bench",
}
# Packages that only some runs of a command import, with their own extra (`ember up` with launch.ray, `ember autoscale`).
MODULE_EXTRAS = {"ray": "ray", "kubernetes": "kubernetes"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ember",
        description="Ember: a self-hosted LLM inference platform.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(f"ember.commands.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `ember` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as exc:  # a host that installed fewer extras than this command needs
        if exc.name is None or exc.name.partition(".")[0] == "ember":
            raise
        extra = MODULE_EXTRAS.get(exc.name.partition(".")[0], COMMAND_EXTRAS[args.command])
        print(f"ember {args.command}: error: {exc}; install it with: pip install 'ember[{extra}]'", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - the CLI prints one clear line, never a traceback
        from ember.errors import EmberError

        if isinstance(exc, EmberError):
            print(f"ember {args.command}: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
