"""POST /v1/chat/completions: the model's chat template over the messages, then generation."""

from __future__ import annotations

from ember.engine.outputs import CompletionOutput, RequestOutput
from ember.engine.sampling_params import SamplingParams
from ember.server.errors import bad_request
from ember.server.logprobs import LogprobFormatter
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
from ember.server.serving import SYSTEM_FINGERPRINT, OpenAIServing, ResponseContext
from ember.server.streaming import TEXT_MARKER, TextChunkTemplate, sse_event


class ChatServing(OpenAIServing[ChatCompletionRequest]):
    request_id_prefix = "chatcmpl"
    prompt_param = "messages"

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

    def encode_prompts(self, request: ChatCompletionRequest) -> list[list[int]]:
        return [self.render_prompt(request.messages, request.add_generation_prompt)]

    def sampling_params_for(self, request: ChatCompletionRequest, prompt_len: int) -> SamplingParams:
        return self.sampling_params(
            request,
            max_tokens=self.max_tokens_for(prompt_len, request.requested_max_tokens),
            logprobs=_top_logprobs(request),
            prompt_logprobs=request.prompt_logprobs,
        )

    def chunk_renderer(self, request: ChatCompletionRequest, context: ResponseContext) -> _ChatChunks:
        return _ChatChunks(self.logprobs, context, request)

    def response(
        self,
        request: ChatCompletionRequest,
        context: ResponseContext,
        finals: list[RequestOutput],
        usage: Usage,
    ) -> ChatCompletionResponse:
        (final,) = finals
        top_logprobs = _top_logprobs(request)
        choices = [
            ChatCompletionChoice(
                index=choice.index,
                message=AssistantMessage(content=choice.text),
                logprobs=None
                if top_logprobs is None or choice.logprobs is None
                else self.logprobs.chat_logprobs(choice.token_ids, choice.logprobs, top_logprobs),
                finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason,
            )
            for choice in final.outputs
        ]
        return ChatCompletionResponse(
            id=context.request_id,
            created=context.created,
            model=context.model,
            system_fingerprint=SYSTEM_FINGERPRINT,
            choices=choices,
            usage=usage,
            prompt_logprobs=self.logprobs.prompt_logprobs(final.prompt_logprobs),
        )


def _top_logprobs(request: ChatCompletionRequest) -> int | None:
    """The engine's logprobs count: None without `logprobs`, else top_logprobs (0: only the sampled token)."""
    return (request.top_logprobs or 0) if request.logprobs else None


class _ChatChunks:
    """Chunks of a streamed chat completion: the role first, then content deltas, then the finish."""

    def __init__(
        self, formatter: LogprobFormatter, context: ResponseContext, request: ChatCompletionRequest
    ) -> None:
        self._formatter = formatter
        self._header = dict(
            id=context.request_id,
            created=context.created,
            model=context.model,
            system_fingerprint=SYSTEM_FINGERPRINT,
        )
        self._n = request.n
        self._top_logprobs = _top_logprobs(request)
        self.include_usage = bool(request.stream_options and request.stream_options.include_usage)
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
            logprobs = self._formatter.chat_logprobs(choice.token_ids, choice.logprobs, self._top_logprobs)
        return ChatCompletionChunkChoice(
            index=index,
            delta=DeltaMessage(content=choice.text),
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=choice.stop_reason if finish_reason else None,
        )

    def usage(self, usage: Usage) -> bytes:
        return self._event(None, usage)
