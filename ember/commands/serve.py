"""`ember serve`: one engine behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import logging
import os

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def register(subparsers: argparse._SubParsersAction) -> None:
    from ember.engine.args import EngineArgs
    from ember.http_protocol import DEFAULT_HEADER_TIMEOUT_S
    from ember.server.settings import API_KEY_ENV

    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
        "/v1/models, /metrics, ...). SIGTERM or Ctrl-C drains in-flight requests, then exits.",
    )
    EngineArgs.add_cli_args(parser, serving=True)
    group = parser.add_argument_group("server")
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="model name(s) clients send in 'model' (default: the --model value)",
    )
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    group.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    group.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize: one shared key for "
        "a single replica, with no scopes or quotas (per-key scopes and limits: ember gateway) "
        f"(default: ${API_KEY_ENV}, else no key)",
    )
    group.add_argument(
        "--metrics-require-auth",
        action="store_true",
        help="require the --api-key on /metrics as well (default: /metrics is open, as Prometheus scrapes it)",
    )
    group.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="requests allowed to wait for the engine; more get 429 (default: unbounded)",
    )
    group.add_argument(
        "--max-queued-tokens",
        type=int,
        default=None,
        help="prompt tokens allowed to wait for the engine; more get 429 (default: unbounded)",
    )
    group.add_argument(
        "--queue-timeout",
        type=float,
        default=None,
        help="seconds a request may wait for the engine before it gets 408 (default: no limit)",
    )
    group.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM/SIGINT (default: %(default)s)",
    )
    group.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=32 * 1024 * 1024,
        help="largest request body accepted; larger gets 413 (default: %(default)s)",
    )
    group.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="seconds a connection gets to send complete request headers before it is closed "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--log-level",
        default="info",
        choices=LOG_LEVELS,
        help="server and access-log verbosity (default: %(default)s)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ember.engine.args import EngineArgs
    from ember.engine.async_engine import AsyncEngine
    from ember.engine.llm_engine import freeze_startup_objects
    from ember.http_protocol import header_timeout_protocol
    from ember.server.app import create_app
    from ember.server.lifecycle import DrainingServer
    from ember.server.settings import ServerSettings

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = ServerSettings(
        served_model_names=tuple(args.served_model_name or [args.model]),
        api_key=args.api_key or None,
        metrics_require_auth=args.metrics_require_auth,
        max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
        queue_timeout=args.queue_timeout,
        drain_timeout=args.drain_timeout,
        max_request_body_bytes=args.max_request_body_bytes,
    )
    http_protocol = header_timeout_protocol(args.header_timeout)
    engine = AsyncEngine.from_engine_args(EngineArgs.from_cli_args(args))
    freeze_startup_objects()
    app = create_app(engine, settings)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        http=http_protocol,
        access_log=False,  # ember.access writes one structured line per request instead
        lifespan="on",
        timeout_graceful_shutdown=5,  # after our own drain, only idle keep-alive connections remain
    )
    server = DrainingServer(config, app.state.lifecycle, app.state.abort_all, lambda: engine.failure)
    server.run()
    return 1 if server.engine_failed else 0
