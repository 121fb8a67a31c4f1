"""What chat and text completions share: the create() skeleton (model check, prompt checks, sampling
parameters, admission, one engine stream per prompt with queue timeout and abort on exit, disconnect
watching, metrics, then a streamed or a whole response). Each endpoint supplies only what differs: its
prompts, its sampling fields, its chunks and its response body."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ember import __version__, sse
from ember.engine.async_engine import AsyncEngine
from ember.engine.errors import EngineError
from ember.engine.outputs import RequestOutput
from ember.engine.sampling_params import SamplingParams, StructuredOutputSpec
from ember.errors import ClientDisconnected
from ember.server.admission import AdmissionController, AdmissionTicket
from ember.server.errors import APIError, bad_request, engine_error
from ember.server.logprobs import LogprobFormatter
from ember.server.metrics import ServerMetrics
from ember.server.middleware import AccessRecord, access_record
from ember.server.protocol import SamplingFields, Usage
from ember.server.settings import ServerSettings
from ember.server.streaming import ChunkRenderer, stream_events
from ember.server.structured_outputs import structured_output_spec

T = TypeVar("T")
RequestT = TypeVar("RequestT", bound=SamplingFields)

SYSTEM_FINGERPRINT = f"ember-{__version__}"


@dataclass(frozen=True)
class ResponseContext:
    """What every chunk and response body of one API request carries."""

    request_id: str
    created: int
    model: str
    prompt_ids: list[list[int]]


class OpenAIServing(ABC, Generic[RequestT]):
    request_id_prefix: str  # request ids read "<prefix>-<32 hex digits>"
    prompt_param: str  # the request field holding the prompt, named in its errors

    def __init__(
        self,
        engine: AsyncEngine,
        settings: ServerSettings,
        admission: AdmissionController,
        metrics: ServerMetrics,
    ) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.settings = settings
        self.admission = admission
        self.metrics = metrics
        self.logprobs = LogprobFormatter(engine.tokenizer)
        self._running: set[str] = set()  # engine request ids in flight, so a drain can abort them

    # ---- what each endpoint defines ---------------------------------------------------------------

    @abstractmethod
    def encode_prompts(self, request: RequestT) -> list[list[int]]:
        """The request's prompts as token ids, one engine request each."""

    @abstractmethod
    def sampling_params_for(self, request: RequestT, prompt_len: int) -> SamplingParams:
        """The engine's parameters for one prompt of `prompt_len` tokens."""

    def grammars_to_check(self, request: RequestT, params: SamplingParams) -> list[StructuredOutputSpec]:
        """The specs to compile before admitting the request: its output constraint, if any."""
        return [params.structured_output] if params.structured_output is not None else []

    @abstractmethod
    def chunk_renderer(self, request: RequestT, context: ResponseContext) -> ChunkRenderer:
        """How the streamed response's chunks look."""

    @abstractmethod
    def response(
        self, request: RequestT, context: ResponseContext, finals: list[RequestOutput], usage: Usage
    ) -> BaseModel:
        """The whole response, from each prompt's final output."""

    # ---- the request ------------------------------------------------------------------------------

    async def create(self, request: RequestT, raw_request: Request) -> Response:
        model = self.served_model(request.model)
        prompt_ids = self.encode_prompts(request)
        for ids in prompt_ids:
            self.engine.check_prompt(ids, self.prompt_param)
        params = [self.sampling_params_for(request, len(ids)) for ids in prompt_ids]
        for spec in self.grammars_to_check(request, params[0]):
            # An invalid schema is a 400 before admission; compiling (once per distinct spec) leaves the loop.
            await asyncio.to_thread(self.engine.compile_structured_output, spec)
        prompt_lens = [len(ids) for ids in prompt_ids]
        ticket = self.admit(len(prompt_ids), sum(prompt_lens))
        request_id = self.new_request_id(self.request_id_prefix)
        record = access_record(raw_request.scope)
        record.completion_id = request_id
        record.prompt_tokens = sum(prompt_lens)
        streams = [
            self.generate(
                ids,
                sampling,
                request_id if len(prompt_ids) == 1 else f"{request_id}-{i}",
                request.priority,
                ticket,
            )
            for i, (ids, sampling) in enumerate(zip(prompt_ids, params, strict=True))
        ]
        merged = merge_streams(streams)
        try:
            if request.stream:
                first = await until_disconnected(raw_request, anext(merged))
            else:
                finals = await until_disconnected(raw_request, _collect(merged, len(prompt_ids)))
        except BaseException as exc:
            await merged.aclose()
            ticket.release()
            if isinstance(exc, ClientDisconnected):
                return disconnected_response()
            raise
        context = ResponseContext(request_id, unix_time(), model, prompt_ids)
        max_tokens = params[0].max_tokens
        if request.stream:
            body = stream_events(
                first,
                merged,
                self.chunk_renderer(request, context),
                num_prompts=len(prompt_ids),
                n=request.n,
                observe_itl=self.metrics.itl.observe,
                finish=partial(
                    self.record_finished, record, prompt_lens=prompt_lens, max_tokens=max_tokens, n=request.n
                ),
                abandon=partial(_record_abandoned, record),
            )
            return StreamingResponse(body, media_type="text/event-stream", headers=sse.HEADERS)
        generated = [sum(len(choice.token_ids) for choice in output.outputs) for output in finals]
        usage = self.record_finished(record, finals, generated, prompt_lens, max_tokens, request.n)
        return json_response(self.response(request, context, finals, usage))

    # ---- request checks ---------------------------------------------------------------------------

    def served_model(self, requested: str | None) -> str:
        """The model name to answer with; 404 for a name this server does not serve."""
        names = self.settings.served_model_names
        if requested is None or requested == "":
            return names[0]
        if requested not in names:
            raise APIError(
                404,
                f"The model `{requested}` does not exist (this server serves: {', '.join(names)})",
                param="model",
                code="model_not_found",
            )
        return requested

    def max_tokens_for(self, prompt_len: int, requested: int | None) -> int:
        """`requested` if prompt + completion fit the context, else 400 context_length_exceeded.

        OpenAI refuses a completion budget past the context where the engine clamps it to the room left,
        so this check is the API's own; the prompt itself was checked by the engine (check_prompt)."""
        limit = self.max_model_len
        if requested is None:
            return limit - prompt_len
        if prompt_len + requested > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the completion). "
                f"Please reduce the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested

    def sampling_params(
        self,
        request: SamplingFields,
        *,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None,
        structured_output: StructuredOutputSpec | None = None,
    ) -> SamplingParams:
        """The engine's parameters for the request; out-of-range values raise the engine's
        InvalidSamplingParamsError, answered as a 400 naming the field. `structured_output` overrides the
        constraint the request's own fields set (tool_choice's grammar)."""
        return SamplingParams(
            n=request.n,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=request.top_k or 0,
            min_p=request.min_p or 0.0,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
            seed=request.seed,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            include_stop_str_in_output=request.include_stop_str_in_output,
            ignore_eos=request.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=request.skip_special_tokens,
            output_kind="delta" if request.stream else "final",
            structured_output=structured_output or structured_output_spec(request),
        )

    def admit(self, num_requests: int, num_prompt_tokens: int) -> AdmissionTicket:
        try:
            return self.admission.admit(num_requests, num_prompt_tokens)
        except APIError:
            self.metrics.count_rejected("queue_full")
            raise

    # ---- running requests -------------------------------------------------------------------------

    @staticmethod
    def new_request_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        priority: int,
        ticket: AdmissionTicket,
    ) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one prompt, with engine failures turned into API errors: 408 if the
        engine has not started the request within the queue timeout. Stopping early (client gone, error)
        closes the engine's stream, which aborts the request there and frees its KV blocks."""
        stream = self.engine.generate(prompt_ids, params, request_id, priority=priority)
        self._running.add(request_id)
        finished = False
        try:
            try:
                async with asyncio.timeout(self.settings.queue_timeout):
                    output = await anext(stream)
            except TimeoutError:
                self.metrics.count_rejected("queue_timeout")
                raise APIError(
                    408,
                    f"The request waited more than {self.settings.queue_timeout:g} s in the "
                    "queue and was dropped; retry later",
                    code="queue_timeout",
                ) from None
            ticket.started()
            finished = output.finished
            yield output
            async for output in stream:
                finished = output.finished
                yield output
        except (GeneratorExit, asyncio.CancelledError):
            if not finished:  # the consumer left first (the client went away): closing the stream aborts it
                self.metrics.count_aborted()
            raise
        except EngineError as exc:
            raise engine_error(exc) from None
        finally:
            self._running.discard(request_id)
            ticket.release()
            await stream.aclose()

    async def abort_all(self) -> None:
        for request_id in list(self._running):
            await self.engine.abort(request_id)

    def record_finished(
        self,
        record: AccessRecord,
        finals: list[RequestOutput],
        generated: list[int],
        prompt_lens: list[int],
        max_tokens: int,
        n: int,
    ) -> Usage:
        """Observe metrics of each finished engine request, fill the access record, return the usage."""
        cached = 0
        record.ttft = None
        for output, prompt_len, num_generated in zip(finals, prompt_lens, generated, strict=True):
            cached += output.num_cached_tokens
            reason = output.outputs[0].finish_reason or "abort"
            record.finish_reason = record.finish_reason or reason
            metrics = output.metrics
            if metrics is not None:
                self.metrics.observe_finished(metrics, reason, prompt_len, num_generated, max_tokens, n)
                if record.ttft is None and metrics.first_token_time is not None:
                    record.ttft = metrics.first_token_time - metrics.arrival_time
        record.prompt_tokens = sum(prompt_lens)
        record.completion_tokens = sum(generated)
        record.cached_tokens = cached
        return Usage.of(record.prompt_tokens, record.completion_tokens, cached)


def _record_abandoned(record: AccessRecord, generated: list[int]) -> None:
    """A stream that ended early (client gone, in-band error): log what was sent."""
    record.completion_tokens = sum(generated)
    record.finish_reason = record.finish_reason or "abort"


async def _collect(merged: AsyncIterator[tuple[int, RequestOutput]], num_prompts: int) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * num_prompts
    async for prompt_index, output in merged:
        finals[prompt_index] = output
    return finals


async def merge_streams(streams: list[AsyncGenerator[T, None]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several streams as (stream index, item), in arrival order; a failure in any ends all."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as stream:  # closed as soon as this is (no GC wait)
            async for item in stream:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    end = object()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item, None))
            await queue.put((index, end, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            await queue.put((index, end, exc))
            if isinstance(exc, asyncio.CancelledError):
                raise

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is end:
                remaining -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so aborting its engine requests) if the client disconnects."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        if work_task.done():
            return work_task.result()
        raise ClientDisconnected()
    finally:
        for task in (work_task, watch_task):
            if not task.done():
                task.cancel()
        await asyncio.gather(work_task, watch_task, return_exceptions=True)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def disconnected_response() -> Response:
    # Nobody reads it; 499 ("client closed request", as nginx) keeps the access log truthful.
    return Response(status_code=499)


def json_response(body: BaseModel) -> Response:
    return Response(body.model_dump_json(), media_type="application/json")


def unix_time() -> int:
    return int(time.time())
