"""Fixtures of the gateway tests; the harness itself is gateway_harness.py in this folder."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from console_browser import browser  # noqa: E402,F401  (the fixture of the console's browser tests)
from gateway_harness import FakeReplica, GatewayServer  # noqa: E402
from protocols_support import ProtocolGateway, protocol_config  # noqa: E402
from shared_stores import shared_state  # noqa: E402,F401  (the fixture of the shared-state tests)


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


@pytest.fixture
def held_gateway(tmp_path):
    """A gateway whose only replica holds requests until released (async jobs and batches)."""
    replica = FakeReplica("held").start()
    config = protocol_config([replica.url])
    config["async"]["jobs"] = {"concurrency": 1, "poll_interval_s": 0.05}
    gateway = ProtocolGateway(config, tmp_path).start()
    yield gateway, replica
    replica.release()
    gateway.stop()
    replica.stop()
