"""POST /v1/chat/completions: the model's chat template over the messages, then generation."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ember.engine.outputs import CompletionOutput, RequestOutput
from ember.server.errors import bad_request
from ember.server.middleware import access_record
from ember.server.protocol import (
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    DeltaMessage,
    Usage,
)
from ember.server.serving import (
    SYSTEM_FINGERPRINT,
    ClientDisconnected,
    OpenAIServing,
    disconnected_response,
    json_response,
    merge_streams,
    unix_time,
    until_disconnected,
)
from ember.server.streaming import SSE_HEADERS, TEXT_MARKER, TextChunkTemplate, sse_event


class ChatServing(OpenAIServing):
    def render_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
        conversation = [{"role": message.role, "content": message.text()} for message in messages]
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt
            )
        except ValueError as exc:
            raise bad_request(str(exc), param="messages") from None
        # The template writes the special tokens (BOS, role markers) itself.
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        model = self.served_model(request.model)
        prompt_ids = self.render_prompt(request.messages, request.add_generation_prompt)
        self.engine.check_prompt(prompt_ids, "messages")
        max_tokens = self.max_tokens_for(len(prompt_ids), request.requested_max_tokens)
        top_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(
            request, max_tokens=max_tokens, logprobs=top_logprobs, streaming=request.stream,
            prompt_logprobs=request.prompt_logprobs,
        )  # fmt: skip
        prompt_lens = [len(prompt_ids)]
        ticket = self.admit(1, len(prompt_ids))
        request_id = self.new_request_id("chatcmpl")
        record = access_record(raw_request.scope)
        record.completion_id = request_id
        record.prompt_tokens = len(prompt_ids)
        merged = merge_streams([self.generate(prompt_ids, params, request_id, request.priority, ticket)])
        try:
            if request.stream:
                first = await until_disconnected(raw_request, anext(merged))
            else:
                final = await until_disconnected(raw_request, _last(merged))
        except BaseException as exc:
            await merged.aclose()
            ticket.release()
            if isinstance(exc, ClientDisconnected):
                return disconnected_response()
            raise
        created = unix_time()
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            renderer = _ChatChunks(self, request_id, created, model, request.n, top_logprobs, include_usage)
            body = self.stream_events(first, merged, renderer, record, prompt_lens, max_tokens, request.n)
            return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)

        choices = [
            ChatCompletionChoice(
                index=choice.index,
                message=AssistantMessage(content=choice.text),
                logprobs=None
                if top_logprobs is None or choice.logprobs is None
                else self.chat_logprobs(choice.token_ids, choice.logprobs, top_logprobs),
                finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason,
            )
            for choice in final.outputs
        ]
        generated = [sum(len(choice.token_ids) for choice in final.outputs)]
        usage = self.record_finished(record, [final], prompt_lens, generated, max_tokens, request.n)
        response = ChatCompletionResponse(
            id=request_id,
            created=created,
            model=model,
            system_fingerprint=SYSTEM_FINGERPRINT,
            choices=choices,
            usage=usage,
            prompt_logprobs=self.prompt_logprobs(final.prompt_logprobs),
        )
        return json_response(response)


async def _last(merged: AsyncIterator[tuple[int, RequestOutput]]) -> RequestOutput:
    final = None
    async for _, output in merged:
        final = output
    return final


class _ChatChunks:
    """Chunks of a streamed chat completion: the role first, then content deltas, then the finish."""

    def __init__(
        self,
        serving: ChatServing,
        request_id: str,
        created: int,
        model: str,
        n: int,
        top_logprobs: int | None,
        include_usage: bool,
    ) -> None:
        self._serving = serving
        self._header = dict(
            id=request_id, created=created, model=model, system_fingerprint=SYSTEM_FINGERPRINT
        )
        self._n = n
        self._top_logprobs = top_logprobs
        self.include_usage = include_usage
        self._templates: dict[int, TextChunkTemplate] = {}

    def _event(self, choice: ChatCompletionChunkChoice | None, usage: Usage | None = None) -> bytes:
        chunk = ChatCompletionChunk(**self._header, choices=[choice] if choice else [], usage=usage)
        return sse_event(chunk.model_dump(mode="json", exclude=None if self.include_usage else {"usage"}))

    def preamble(self, prompt_index: int, output: RequestOutput) -> list[bytes]:
        return [
            self._event(
                ChatCompletionChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
            )
            for index in range(self._n)
        ]

    def delta(self, index: int, choice: CompletionOutput) -> bytes | None:
        if self._top_logprobs is None:
            if not choice.text:
                return None
            template = self._templates.get(index)
            if template is None:
                template = self._templates[index] = TextChunkTemplate(
                    self._event(
                        ChatCompletionChunkChoice(index=index, delta=DeltaMessage(content=TEXT_MARKER))
                    )
                )
            return template.render(choice.text)
        if not choice.token_ids:
            return None
        return self._event(self._choice(index, choice, None))

    def final(self, index: int, choice: CompletionOutput) -> bytes:
        return self._event(self._choice(index, choice, choice.finish_reason))

    def _choice(
        self, index: int, choice: CompletionOutput, finish_reason: str | None
    ) -> ChatCompletionChunkChoice:
        logprobs = None
        if self._top_logprobs is not None and choice.logprobs is not None:
            logprobs = self._serving.chat_logprobs(choice.token_ids, choice.logprobs, self._top_logprobs)
        return ChatCompletionChunkChoice(
            index=index,
            delta=DeltaMessage(content=choice.text),
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=choice.stop_reason if finish_reason else None,
        )

    def usage(self, usage: Usage) -> bytes:
        return self._event(None, usage)
