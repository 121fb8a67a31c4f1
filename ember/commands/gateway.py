"""`ember gateway --config fleet.yaml`: the fleet's front door (keys, limits, queue, routing, failover)."""

from __future__ import annotations

import argparse
import importlib.util


def register(subparsers: argparse._SubParsersAction) -> None:
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
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn log level (default warning: access logs cost throughput on the proxy path)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ember.gateway.app import create_app
    from ember.gateway.config import load_config
    from ember.gateway.extensions import protocol_extensions

    config = load_config(args.config)  # a bad file fails here, before anything listens
    app = create_app(config, protocol_extensions(config, args.grpc_port))
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        proxy_headers=False,  # the gateway never reads the client address; skip the middleware per request
        loop="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        http="httptools" if importlib.util.find_spec("httptools") else "h11",
        timeout_graceful_shutdown=10,
    )
    return 0
