"""What chat and text completions share: model check, context-length check, sampling parameters,
admission, the engine stream with queue timeout and abort on exit, disconnect watching, metrics."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from ember import __version__
from ember.engine.async_engine import AsyncEngine
from ember.engine.errors import EngineError
from ember.engine.outputs import CompletionOutput, Logprob, RequestOutput
from ember.engine.sampling_params import SamplingParams
from ember.server.admission import AdmissionController, AdmissionTicket
from ember.server.errors import APIError, bad_request, engine_error
from ember.server.metrics import ServerMetrics
from ember.server.middleware import AccessRecord
from ember.server.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    SamplingFields,
    TopLogprob,
    Usage,
)
from ember.server.settings import ServerSettings
from ember.server.streaming import DONE, sse_event

T = TypeVar("T")

SYSTEM_FINGERPRINT = f"ember-{__version__}"
# JSON has no -inf; vLLM reports this floor for tokens the model rules out.
MIN_LOGPROB = -9999.0


class ChunkRenderer(Protocol):
    """How one endpoint shapes its stream's chunks; `index` is the choice index in the response."""

    include_usage: bool

    def preamble(self, prompt_index: int, output: RequestOutput) -> list[bytes]:
        """Chunks that open one prompt's choices, sent before its first output's (which is `output`)."""
        ...

    def delta(self, index: int, choice: CompletionOutput) -> bytes | None: ...

    def final(self, index: int, choice: CompletionOutput) -> bytes: ...

    def usage(self, usage: Usage) -> bytes: ...


class ClientDisconnected(Exception):
    """The client went away before the response was ready; nothing is sent back."""


class OpenAIServing:
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
        self._running: set[str] = set()  # engine request ids in flight, so a drain can abort them

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
        streaming: bool,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The engine's parameters for the request; out-of-range values raise the engine's
        InvalidSamplingParamsError, answered as a 400 naming the field."""
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
            output_kind="delta" if streaming else "final",
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
            yield output
            async for output in stream:
                yield output
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
        prompt_lens: list[int],
        generated: list[int],
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

    async def stream_events(
        self,
        first: tuple[int, RequestOutput],
        merged: AsyncIterator[tuple[int, RequestOutput]],
        renderer: ChunkRenderer,
        record: AccessRecord,
        prompt_lens: list[int],
        max_tokens: int,
        n: int,
    ) -> AsyncIterator[bytes]:
        """The SSE body: the renderer's chunks for each engine output, the usage chunk, [DONE].

        Engine outputs are deltas and list every choice each time; a choice already finished is skipped."""
        num_prompts = len(prompt_lens)
        finals: list[RequestOutput | None] = [None] * num_prompts
        generated = [0] * num_prompts
        last_token_time: list[float | None] = [None] * num_prompts
        done: set[int] = set()
        opened: set[int] = set()
        itl = self.metrics.itl
        item: tuple[int, RequestOutput] | None = first
        try:
            while item is not None:
                prompt_index, output = item
                if prompt_index not in opened:
                    opened.add(prompt_index)
                    for event in renderer.preamble(prompt_index, output):
                        yield event
                now = time.monotonic()
                previous = last_token_time[prompt_index]
                if previous is not None:
                    itl.observe(now - previous)
                last_token_time[prompt_index] = now
                base = prompt_index * n
                for choice in output.outputs:
                    index = base + choice.index
                    if index in done:
                        continue
                    generated[prompt_index] += len(choice.token_ids)
                    if choice.finish_reason is None:
                        event = renderer.delta(index, choice)
                        if event is not None:
                            yield event
                    else:
                        done.add(index)
                        yield renderer.final(index, choice)
                if output.finished:
                    finals[prompt_index] = output
                item = await anext(merged, None)
            usage = self.record_finished(record, finals, prompt_lens, generated, max_tokens, n)
            if renderer.include_usage:
                yield renderer.usage(usage)
            yield DONE
        except APIError as exc:  # the status line is sent already: report in-band, as vLLM does
            yield sse_event(exc.body())
            yield DONE
        finally:
            if record.completion_tokens is None:  # ended early (client gone): log what was sent
                record.completion_tokens = sum(generated)
                record.finish_reason = record.finish_reason or "abort"
            await merged.aclose()

    # ---- logprobs -----------------------------------------------------------------------------------

    def token_text(self, token_id: int, logprob: Logprob | None) -> str:
        """The token's text as the engine decoded it for its logprob entry. Only an echoed prompt's first
        token has no entry (nothing precedes it to score it); its text is decoded here, as echo's is."""
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _top(self, entries: dict[int, Logprob], k: int) -> list[tuple[str, float]]:
        ranked = sorted(entries.items(), key=lambda item: item[1].rank)[:k]
        return [(self.token_text(tid, lp), max(lp.logprob, MIN_LOGPROB)) for tid, lp in ranked]

    def chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]], k: int) -> ChatLogprobs:
        content = []
        for token_id, entries in zip(token_ids, logprobs, strict=False):
            sampled = entries.get(token_id)
            text = self.token_text(token_id, sampled)
            content.append(
                ChatTokenLogprob(
                    token=text,
                    logprob=MIN_LOGPROB if sampled is None else max(sampled.logprob, MIN_LOGPROB),
                    bytes=list(text.encode("utf-8")),
                    top_logprobs=[
                        TopLogprob(token=t, logprob=lp, bytes=list(t.encode("utf-8")))
                        for t, lp in self._top(entries, k)
                    ],
                )
            )
        return ChatLogprobs(content=content)

    def prompt_logprobs(self, entries: list[dict[int, Logprob] | None] | None) -> PromptLogprobs | None:
        """vLLM's prompt_logprobs field: per prompt token (None for the first), token id -> logprob, rank and
        text, -inf floored as everywhere in the API."""
        if entries is None:
            return None
        return [
            None if entry is None else {
                token_id: PromptLogprob(logprob=max(lp.logprob, MIN_LOGPROB), rank=lp.rank,
                                        decoded_token=self.token_text(token_id, lp))
                for token_id, lp in entry.items()
            }
            for entry in entries
        ]  # fmt: skip

    def completion_logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, Logprob] | None], k: int, text_offset: int
    ) -> CompletionLogprobs:
        """Completions' logprobs; an entry of None (the first prompt token with echo) has no logprob."""
        result = CompletionLogprobs()
        for token_id, entries in zip(token_ids, logprobs, strict=False):
            sampled = entries.get(token_id) if entries else None
            text = self.token_text(token_id, sampled)
            result.tokens.append(text)
            result.text_offset.append(text_offset)
            text_offset += len(text)
            if entries is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(
                MIN_LOGPROB if sampled is None else max(sampled.logprob, MIN_LOGPROB)
            )
            top = dict(self._top(entries, k))
            if sampled is not None:  # as vLLM (and OpenAI's legacy API): the chosen token is always listed
                top.setdefault(text, max(sampled.logprob, MIN_LOGPROB))
            result.top_logprobs.append(top)
        return result


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several streams as (stream index, item), in arrival order; a failure in any ends all."""
    if len(streams) == 1:
        async for item in streams[0]:
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
