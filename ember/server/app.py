"""The FastAPI application: routes, middleware and error handlers over one AsyncEngine."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import JSONResponse, Response

from ember import __version__
from ember.engine.async_engine import AsyncEngine
from ember.server.admission import AdmissionController
from ember.server.errors import APIError, install_error_handlers
from ember.server.lifecycle import DrainGate, Lifecycle
from ember.server.metrics import ServerMetrics
from ember.server.middleware import AccessLog, APIKeyAuth, BodySizeLimit, JSONContentType
from ember.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    EmberModelInfo,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from ember.server.serving import json_response
from ember.server.serving_chat import ChatServing
from ember.server.serving_completions import CompletionsServing
from ember.server.settings import ServerSettings
from ember.webui import console_router

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
JSON_POST_PATHS = GENERATION_PATHS | {"/tokenize", "/detokenize"}


def create_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    """The OpenAI-compatible app. Starting it (lifespan) starts the engine thread; stopping it stops the engine."""
    lifecycle = Lifecycle(settings.drain_timeout)
    runner = engine.runner
    metrics = ServerMetrics(settings.served_model_names[0], engine.stats, runner.kernel_paths,
                            runner.cache_config)
    ember_info = EmberModelInfo(
        dtype=str(runner.dtype).removeprefix("torch."),
        dtype_reason=runner.dtype_reason,
        kernel_level=runner.kernel_level,
        kernels=runner.kernel_paths,
        kv_cache_dtype=runner.kv_cache_dtype,
    )
    admission = AdmissionController(
        settings.max_queued_requests, settings.max_queued_tokens, settings.retry_after_s
    )
    chat = ChatServing(engine, settings, admission, metrics)
    completions = CompletionsServing(engine, settings, admission, metrics)
    created = int(time.time())

    async def abort_all() -> None:
        await chat.abort_all()
        await completions.abort_all()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        lifecycle.ready = True
        try:
            yield
        finally:
            lifecycle.ready = False
            await engine.shutdown()

    app = FastAPI(
        title="Ember", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.lifecycle = lifecycle
    app.state.abort_all = abort_all
    app.state.metrics = metrics
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat.create(body, request)

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await completions.create(body, request)

    @app.get("/v1/models")
    async def list_models() -> Response:
        cards = [
            ModelCard(
                id=name,
                created=created,
                root=str(engine.source),
                max_model_len=engine.max_model_len,
                ember=ember_info,
            )
            for name in settings.served_model_names
        ]
        return json_response(ModelList(data=cards))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        chat.served_model(body.model)
        if body.messages is not None:
            tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
            tokens = chat.render_prompt(body.messages, body.add_generation_prompt, tools or None)
        else:
            tokens = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        token_strs = [text or "" for text in engine.tokenizer.convert_ids_to_tokens(tokens)]
        return json_response(
            TokenizeResponse(
                count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens, token_strs=token_strs
            )
        )

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        chat.served_model(body.model)
        engine.check_token_ids(body.tokens, "tokens")
        return json_response(DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens)))

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            raise APIError(503, "The engine thread is not running", code="engine_dead")
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        if lifecycle.draining:
            raise APIError(503, "The server is shutting down", code="server_draining")
        if not lifecycle.ready or not engine.is_running:
            raise APIError(503, "The server is not ready", code="not_ready")
        return JSONResponse({"status": "ready"})

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    app.include_router(console_router("serve.html"))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    # Added innermost first: AccessLog ends up outermost, so it sees every status (413, 401, 503 too).
    app.add_middleware(DrainGate, lifecycle=lifecycle, paths=GENERATION_PATHS)
    if settings.api_key:
        app.add_middleware(
            APIKeyAuth, api_key=settings.api_key, protect_metrics=settings.metrics_require_auth
        )
    app.add_middleware(JSONContentType, paths=JSON_POST_PATHS)  # as the gateway: 415 before 401
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_body_bytes)
    app.add_middleware(AccessLog)
    return app
