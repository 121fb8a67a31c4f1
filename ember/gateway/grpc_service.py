"""The `ember.v1.Inference` gRPC service (ember/gateway/proto/ember/v1/inference.proto), served by the
gateway on `--grpc-port` inside the gateway's event loop, through the same dispatcher as HTTP.

Auth comes from the `authorization` metadata (`Bearer <key>`). The client's gRPC deadline bounds the
wait in the gateway's queue and the whole call. Gateway errors map to gRPC status codes:
401 UNAUTHENTICATED, 403 PERMISSION_DENIED, 404 NOT_FOUND, 408 DEADLINE_EXCEEDED,
429 RESOURCE_EXHAUSTED (with retry-after in the trailing metadata), other 4xx INVALID_ARGUMENT,
5xx UNAVAILABLE.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
import orjson
from fastapi import APIRouter

from ember.gateway.errors import GatewayError, bad_request
from ember.gateway.keys import Principal
from ember.gateway.proto.ember.v1 import inference_pb2 as pb
from ember.gateway.proto.ember.v1 import inference_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from ember.gateway.extensions import GatewayServices

logger = logging.getLogger("ember.gateway.grpc")

STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
)
# GenerateRequest's <name>_json fields: OpenAI request fields carried as JSON text.
JSON_FIELDS = ("response_format", "structured_outputs", "tools", "tool_choice")


def grpc_status(http_status: int) -> grpc.StatusCode:
    if http_status in STATUS_CODES:
        return STATUS_CODES[http_status]
    return grpc.StatusCode.UNAVAILABLE if http_status >= 500 else grpc.StatusCode.INVALID_ARGUMENT


def to_openai(request: pb.GenerateRequest, stream: bool) -> tuple[str, dict[str, Any]]:
    """(dispatcher endpoint, OpenAI request body) for a GenerateRequest."""
    body: dict[str, Any] = {"model": request.model}
    which = request.WhichOneof("input")
    if which == "prompt":
        endpoint = "completions"
        body["prompt"] = request.prompt
    elif which == "chat":
        endpoint = "chat/completions"
        body["messages"] = [_message(m) for m in request.chat.messages]
    else:
        raise bad_request("Set either 'prompt' or 'chat'.", param="input")
    for name in SAMPLING_FIELDS:
        if request.HasField(name):
            body[name] = getattr(request, name)
    for name in JSON_FIELDS:
        text = getattr(request, f"{name}_json")
        if text:
            try:
                body[name] = orjson.loads(text)
            except orjson.JSONDecodeError as exc:
                raise bad_request(f"{name}_json is not valid JSON: {exc}", param=f"{name}_json") from None
    if request.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = request.parallel_tool_calls
    if request.stop:
        body["stop"] = list(request.stop)
    if request.ignore_eos:
        body["ignore_eos"] = True
    if request.user:
        body["user"] = request.user
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return endpoint, body


def _message(message: pb.ChatMessage) -> dict[str, Any]:
    entry: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        entry["tool_calls"] = [{"id": call.id, "type": "function",
                                "function": {"name": call.name, "arguments": call.arguments}}
                               for call in message.tool_calls]
    if message.tool_call_id:
        entry["tool_call_id"] = message.tool_call_id
    return entry


def tool_call_messages(calls: list[dict[str, Any]] | None) -> list[pb.ToolCall]:
    """An OpenAI message's tool_calls as ToolCall messages."""
    return [pb.ToolCall(id=call.get("id") or "", name=call["function"].get("name") or "",
                        arguments=call["function"].get("arguments") or "") for call in calls or ()]


def choice_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    holder = choice.get("delta") or choice.get("message") or {}
    return holder.get("content") or ""


def usage_message(usage: dict[str, Any] | None) -> pb.Usage | None:
    if not usage:
        return None
    return pb.Usage(
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        total_tokens=int(usage.get("total_tokens") or 0),
    )


def upstream_error(status: int, payload: Any) -> GatewayError:
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict):
        return GatewayError(status, f"The replica answered HTTP {status}.", "upstream_error")
    return GatewayError(
        status,
        str(error.get("message")),
        error.get("type") or "upstream_error",
        error.get("code"),
        error.get("param"),
    )


class InferenceService(pb_grpc.InferenceServicer):
    def __init__(self, dispatcher: GatewayServices) -> None:
        self.dispatcher = dispatcher

    async def _fail(self, context: grpc.aio.ServicerContext, exc: GatewayError) -> None:
        retry_after = exc.headers.get("retry-after") or exc.headers.get("Retry-After")
        if retry_after is not None:
            context.set_trailing_metadata((("retry-after", str(retry_after)),))
        await context.abort(grpc_status(exc.status), exc.message)

    def _authenticate(self, context: grpc.aio.ServicerContext) -> Principal:
        metadata = dict(context.invocation_metadata() or ())
        return self.dispatcher.authenticate(metadata.get("authorization"))

    async def _dispatch(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, stream: bool):
        principal = self._authenticate(context)
        endpoint, body = to_openai(request, stream)
        return await self.dispatcher.dispatch(
            principal,
            endpoint,
            body,
            priority=request.priority if request.HasField("priority") else None,
            deadline_s=context.time_remaining(),
            client_region=request.region or None,
            session_id=request.session_id or None,
        )

    async def Generate(  # noqa: N802 - gRPC method names
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateChunk]:
        result = None
        try:
            result = await self._dispatch(request, context, stream=True)
            if not result.stream:
                raise upstream_error(result.status, orjson.loads(result.body or b"null"))
            chunk_id, finish_reason, usage = "", "", None
            calls: dict[int, dict[str, Any]] = {}  # streamed tool calls by index, accumulated
            async for payload in result.events():
                chunk = orjson.loads(payload)
                if "error" in chunk:
                    error = chunk["error"] or {}
                    raise GatewayError(502, str(error.get("message", "The stream failed.")), "server_error")
                chunk_id = chunk.get("id") or chunk_id
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    finish_reason = choice.get("finish_reason") or finish_reason
                    for piece in (choice.get("delta") or {}).get("tool_calls") or ():
                        call = calls.setdefault(piece["index"], {"id": "", "function": {"name": "", "arguments": ""}})
                        call["id"] = piece.get("id") or call["id"]
                        function = piece.get("function") or {}
                        call["function"]["name"] += function.get("name") or ""
                        call["function"]["arguments"] += function.get("arguments") or ""
                    text = choice_text(choice)
                    if text:
                        yield pb.GenerateChunk(id=chunk_id, text=text)
            yield pb.GenerateChunk(id=chunk_id, finish_reason=finish_reason, usage=usage_message(usage),
                                   tool_calls=tool_call_messages([calls[index] for index in sorted(calls)]))
        except GatewayError as exc:
            await self._fail(context, exc)
        finally:
            if result is not None:
                await result.aclose()

    async def Complete(  # noqa: N802
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.CompleteResponse:
        result = None
        try:
            result = await self._dispatch(request, context, stream=False)
            payload = orjson.loads(result.body or b"null")
            if not 200 <= result.status < 300:
                raise upstream_error(result.status, payload)
            choice = (payload.get("choices") or [{}])[0]
            return pb.CompleteResponse(
                id=payload.get("id") or "",
                model=payload.get("model") or request.model,
                text=choice_text(choice),
                finish_reason=choice.get("finish_reason") or "",
                usage=usage_message(payload.get("usage")),
                tool_calls=tool_call_messages((choice.get("message") or {}).get("tool_calls")),
            )
        except GatewayError as exc:
            await self._fail(context, exc)
        finally:
            if result is not None:
                await result.aclose()

    async def ListModels(  # noqa: N802
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        try:
            principal = self._authenticate(context)
        except GatewayError as exc:
            await self._fail(context, exc)
        models = [
            pb.Model(id=name, owned_by="ember-gateway")
            for name in self.dispatcher.config.models
            if principal.policy.allows_model(name)
        ]
        return pb.ListModelsResponse(models=models)

    async def Health(  # noqa: N802
        self, request: pb.HealthRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthResponse:
        pool = self.dispatcher.pool
        healthy = {model: len(pool.healthy(model)) for model in pool.models}
        serving = bool(healthy) and all(healthy.values())
        status = pb.HealthResponse.SERVING if serving else pb.HealthResponse.NOT_SERVING
        return pb.HealthResponse(status=status, healthy_replicas=healthy)


class GrpcExtension:
    """Starts and stops the gRPC listener with the gateway (it has no HTTP routes)."""

    def __init__(self, dispatcher: GatewayServices, host: str, port: int) -> None:
        self.dispatcher = dispatcher
        self.host = host
        self.port = port
        self.bound_port: int | None = None
        self.router = APIRouter()
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        server = grpc.aio.server()
        pb_grpc.add_InferenceServicer_to_server(InferenceService(self.dispatcher), server)
        self.bound_port = server.add_insecure_port(f"{self.host}:{self.port}")
        if not self.bound_port:
            raise OSError(f"cannot listen for gRPC on {self.host}:{self.port}")
        await server.start()
        self._server = server
        logger.info("gRPC listening on %s:%d", self.host, self.bound_port)

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=2.0)
            self._server = None
