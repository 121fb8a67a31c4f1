"""Subcommands of the `ember` CLI; each module exposes `register(subparsers)`."""
