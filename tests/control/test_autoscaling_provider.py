"""The local provider against a real gateway: a replica it starts is registered and admitted, one the
gateway forgot (a restarted gateway knows only its config) is registered again, and a stop drains it
out of the gateway before its process is stopped. The processes are fake replicas on the ports the
provider picks (a stand-in supervisor starts them), so no model loads."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "gateway"))

from gateway_harness import FakeReplica, GatewayServer, gateway_config, http  # noqa: E402

from ember.control.autoscaling.provider import GatewayAdmin, LocalProcessProvider, ReplicaState  # noqa: E402
from ember.control.fleet import AutoscaledModel, ChildSpec  # noqa: E402
from ember.gateway.admin import CONTROL_TOKEN_ENV  # noqa: E402
from ember.gateway.config import AutoscalingConfig  # noqa: E402

TOKEN = "provider-test-token"


class FakeSupervisor:
    """Starts a fake replica on the port of each child it is asked to run."""

    def __init__(self) -> None:
        self.running: dict[str, FakeReplica] = {}

    def add_child(self, spec: ChildSpec) -> None:
        port = int(spec.argv[spec.argv.index("--port") + 1])
        self.running[spec.name] = FakeReplica(spec.name, port).start()

    async def remove_child(self, name: str) -> None:
        self.running.pop(name).stop()

    def stop_all(self) -> None:
        for replica in self.running.values():
            replica.stop()


@pytest.fixture
def gateway(tmp_path, monkeypatch):
    monkeypatch.setenv(CONTROL_TOKEN_ENV, TOKEN)
    model = {"deployments": [{"replicas": []}],
             "autoscaling": {"min_replicas": 0, "max_replicas": 2, "ttft_p90_ms": 1000, "itl_p90_ms": 100}}  # fmt: skip
    server = GatewayServer(gateway_config({"tiny": model}, [{"name": "k", "secret": "sk"}]), tmp_path)
    server.server.start()
    yield server
    server.server.stop()


async def wait_for(condition, limit_s: float = 30.0) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.05)

    await asyncio.wait_for(poll(), limit_s)


async def test_start_register_forget_resync_and_stop_with_drain(gateway):
    autoscaling = AutoscalingConfig(min_replicas=0, max_replicas=2, ttft_p90_ms=1000, itl_p90_ms=100)
    models = {"tiny": AutoscaledModel("tiny", autoscaling, ["serve", "--model", "m"], "127.0.0.1", 2, None)}
    supervisor = FakeSupervisor()
    provider = LocalProcessProvider(supervisor, models, GatewayAdmin(gateway.url, TOKEN, drain_timeout_s=5), "fleet-credential", log=lambda line: None)
    try:
        await provider.start()
        assert len(supervisor.running) == 1  # the standby, waiting
        replica = await provider.start_replica("tiny")
        assert replica.state == ReplicaState.LOADING and len(supervisor.running) == 2  # and the next standby
        await wait_for(lambda: replica.state == ReplicaState.READY)
        assert gateway.dispatcher.pool.get(replica.id).healthy and replica.cold_start_s > 0

        # The gateway loses it (as a restarted gateway would): the next resync registers it again.
        assert http.delete(f"{gateway.url}/admin/replicas/{replica.id}", headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200
        await provider.resync()
        assert replica.state == ReplicaState.LOADING
        await wait_for(lambda: replica.state == ReplicaState.READY)
        assert gateway.dispatcher.pool.get(replica.id).healthy

        await provider.stop_replica(replica.id)
        assert gateway.dispatcher.pool.get(replica.id) is None and provider.list_replicas() == []
        assert f"replica-{replica.url.rsplit(':', 1)[1]}" not in supervisor.running
    finally:
        await provider.close()
        supervisor.stop_all()
