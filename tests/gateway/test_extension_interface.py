"""The typed extension interface (ember/gateway/extensions.py) matches what the gateway really hands
its extensions and what the built-in extensions really are (members checked at run time)."""

from __future__ import annotations

from pathlib import Path

from ember.gateway.app import create_app
from ember.gateway.config import parse_config
from ember.gateway.extensions import GatewayExtension, GatewayServices, JobsExtension, protocol_extensions
from ember.gateway.grpc_service import GrpcExtension
from ember.gateway.ws import WebSocketExtension


def test_the_dispatcher_provides_gateway_services_and_built_ins_are_extensions(tmp_path: Path):
    config = parse_config(
        {
            "models": {"tiny": {"deployments": [{"replicas": [{"url": "http://127.0.0.1:9"}]}]}},
            "async": {"store": "jobs.db", "grpc": {"port": 0}},
        },
        base_dir=tmp_path,
    )
    app = create_app(config, protocol_extensions(config))  # built, never started: nothing listens

    assert isinstance(app.dispatcher, GatewayServices)
    assert [type(extension) for extension in app.extensions] == [JobsExtension, WebSocketExtension, GrpcExtension]
    assert all(isinstance(extension, GatewayExtension) for extension in app.extensions)
    assert app.extensions[0].runtime.dispatcher is app.dispatcher


def test_a_gateway_without_grpc_port_mounts_no_grpc_extension():
    config = parse_config({"models": {"tiny": {"deployments": [{"replicas": [{"url": "http://127.0.0.1:9"}]}]}}})
    app = create_app(config, protocol_extensions(config))
    assert [type(extension) for extension in app.extensions] == [JobsExtension, WebSocketExtension]
