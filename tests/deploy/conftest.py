"""The deploy tests import their helpers (helm_renderer, fake_kube_api) from this folder; the Kubernetes
tests share the fake API server and the replicas that play a Deployment's pods."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "gateway"))  # gateway_harness: FakeReplica, GatewayServer

from fake_kube_api import FakeKubeApi  # noqa: E402
from gateway_harness import FakeReplica, GatewayServer, free_port, gateway_config  # noqa: E402
from kube_scenario import CONTROL_TOKEN, DEPLOYMENT, KEY, PODS  # noqa: E402

from ember.gateway.admin import CONTROL_TOKEN_ENV  # noqa: E402


@pytest.fixture
def fake_api(tmp_path, monkeypatch):
    api = FakeKubeApi("ember").start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(api.kubeconfig())
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    yield api
    api.stop()


@pytest.fixture
def pods():
    """Three replicas on 127.0.0.2-4, one port: what the pods of a Deployment look like to the gateway."""
    port = free_port()
    started = [FakeReplica(pod, port=port, host=f"127.0.0.{n + 2}").start() for n, pod in enumerate(PODS)]
    yield started
    for replica in started:
        replica.stop()


@pytest.fixture
def static_replica():
    replica = FakeReplica("static").start()
    yield replica
    replica.stop()


@pytest.fixture
def gateway(fake_api, pods, static_replica, tmp_path, monkeypatch):
    """A gateway with `tiny` discovered from the Service (2 pods, not Ready yet; round-robin, so which pod
    serves is certain) and `plain` static."""
    monkeypatch.setenv("EMBER_FLEET_CREDENTIAL", "fleet-secret")
    monkeypatch.setenv(CONTROL_TOKEN_ENV, CONTROL_TOKEN)
    fake_api.add_deployment(DEPLOYMENT, DEPLOYMENT, pods[0].server.port, lambda n: f"127.0.0.{n + 1}", replicas=2)
    discovered = {"routing": {"policy": "round-robin"}, "deployments": [{"name": "main", "model": "tiny-v1", "api_key_env": "EMBER_FLEET_CREDENTIAL",
                                   "discovery": {"kubernetes": {"service": DEPLOYMENT, "port": "http", "capacity": 4}}}]}  # fmt: skip
    static = {"deployments": [{"name": "main", "replicas": [{"url": static_replica.url, "id": "static"}]}]}
    server = GatewayServer(gateway_config({"tiny": discovered, "plain": static}, [{"name": "k", "secret": KEY}]), tmp_path)
    server.server.start()
    yield server
    server.server.stop()
