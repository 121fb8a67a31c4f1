"""`ember gateway --config fleet.yaml`: the fleet's front door (keys, limits, queue, routing, failover)."""

from __future__ import annotations

import argparse
import importlib.util
import os


def register(subparsers: argparse._SubParsersAction) -> None:
    from ember.http_protocol import DEFAULT_HEADER_TIMEOUT_S

    parser = subparsers.add_parser(
        "gateway",
        help="Run the gateway in front of OpenAI-compatible replicas (ember serve, vLLM, SGLang, llama.cpp)",
        description="Run the gateway described by one YAML config file.",
    )
    parser.add_argument("--config", required=True, help="The gateway's YAML config file (models, replicas, keys...)")
    parser.add_argument("--host", default="127.0.0.1", help="Address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on (default 8000)")
    parser.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help="Also serve the ember.v1.Inference gRPC API on this port (default: async.grpc.port, else off)",
    )
    parser.add_argument(
        "--config-overlay",
        action="append",
        default=[],
        metavar="PATH",
        help="A YAML file merged over --config (repeatable; on Kubernetes: the keys Secret over the ConfigMap)",
    )
    parser.add_argument(
        "--fleet-replicas",
        nargs="+",
        default=[],
        metavar="ID",
        help="Ids of the replicas `ember up` started: the gateway sends them the fleet's service credential, "
        "read from $EMBER_FLEET_CREDENTIAL (`ember up` passes both)",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="Seconds a connection gets to send complete request headers before it is closed (default %(default)s)",
    )
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn log level (default warning: access logs cost throughput on the proxy path)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ember.errors import EmberError
    from ember.gateway.app import create_app
    from ember.gateway.config import FLEET_CREDENTIAL_ENV, load_config, with_replica_api_keys
    from ember.gateway.extensions import protocol_extensions
    from ember.http_protocol import header_timeout_protocol

    http_protocol = header_timeout_protocol(args.header_timeout)
    config = load_config(args.config, args.config_overlay)  # a bad file fails here, before anything listens
    if args.fleet_replicas:
        credential = os.environ.get(FLEET_CREDENTIAL_ENV)
        if not credential:
            raise EmberError(f"--fleet-replicas needs the fleet's credential in ${FLEET_CREDENTIAL_ENV}")
        config = with_replica_api_keys(config, dict.fromkeys(args.fleet_replicas, credential))
    discovered = any(d.discovery is not None for model in config.models.values() for d in model.deployments)
    if discovered and importlib.util.find_spec("kubernetes") is None:
        raise EmberError("discovery.kubernetes needs the official client: pip install 'ember[kubernetes]'")
    app = create_app(config, protocol_extensions(config, args.grpc_port))
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        proxy_headers=False,  # the gateway never reads the client address; skip the middleware per request
        loop="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        http=http_protocol,
        timeout_graceful_shutdown=10,
    )
    return 0
