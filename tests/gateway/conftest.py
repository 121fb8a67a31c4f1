"""Fixtures of the gateway tests; the harness itself is gateway_harness.py in this folder."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from gateway_harness import FakeReplica, GatewayServer  # noqa: E402


@pytest.fixture
def replicas() -> Iterator[list[FakeReplica]]:
    """Two started fake replicas, a and b."""
    started = [FakeReplica("a").start(), FakeReplica("b").start()]
    yield started
    for replica in started:
        replica.stop()


@pytest.fixture
def start_gateway(tmp_path: Path):
    servers: list[GatewayServer] = []

    def start(config: dict) -> GatewayServer:
        gateway = GatewayServer(config, tmp_path)
        gateway.server.start()
        servers.append(gateway)
        return gateway

    yield start
    for gateway in servers:
        gateway.server.stop()
