"""POST /v1/chat/completions: the model's chat template over the messages, then generation; with tools, the
tool calls parsed out of the output (ember/server/tool_calls.py)."""

from __future__ import annotations

from typing import Any

from ember.engine.errors import InvalidRequestError
from ember.engine.outputs import CompletionOutput, RequestOutput
from ember.engine.sampling_params import SamplingParams, StructuredOutputSpec
from ember.loader.tokenizer import compile_chat_template
from ember.server.errors import bad_request
from ember.server.logprobs import LogprobFormatter
from ember.server.protocol import (
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    DeltaMessage,
    DeltaToolCall,
    Usage,
)
from ember.server.serving import SYSTEM_FINGERPRINT, OpenAIServing, ResponseContext
from ember.server.streaming import TEXT_MARKER, TextChunkTemplate, sse_event
from ember.server.structured_outputs import structured_output_spec
from ember.server.tool_call_streams import ConstrainedToolCallStream, HermesToolCallStream
from ember.server.tool_calls import (
    DEFAULT_SYSTEM,
    HERMES_TOOL_TEMPLATE,
    ToolPlan,
    conversation,
    parse_tool_calls,
    plan_tools,
    tool_call_stream,
    tool_schemas,
)


class ChatServing(OpenAIServing[ChatCompletionRequest]):
    request_id_prefix = "chatcmpl"
    prompt_param = "messages"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        own = self.tokenizer.chat_template or ""
        # A ChatML template without a tools branch (SmolLM2's) gets the Hermes tool format; any other template
        # renders tools itself (or ignores them).
        self._tool_template = (
            compile_chat_template(HERMES_TOOL_TEMPLATE)
            if "<|im_start|>" in own and "tools" not in own
            else None
        )

    def render_prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        uses_tools = tools or any(message.tool_calls or message.role == "tool" for message in messages)
        try:
            text = self.tokenizer.apply_chat_template(
                conversation(messages),
                add_generation_prompt=add_generation_prompt,
                tools=tools or None,
                chat_template=self._tool_template if uses_tools else None,
                default_system=DEFAULT_SYSTEM,
            )
        except ValueError as exc:
            raise bad_request(str(exc), param="messages") from None
        # The template writes the special tokens (BOS, role markers) itself.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_prompts(self, request: ChatCompletionRequest) -> list[list[int]]:
        plan = plan_tools(request)
        return [
            self.render_prompt(
                request.messages, request.add_generation_prompt, plan.tools if plan is not None else None
            )
        ]

    def sampling_params_for(self, request: ChatCompletionRequest, prompt_len: int) -> SamplingParams:
        plan = plan_tools(request)
        tool_grammar = plan.spec if plan is not None else None
        if tool_grammar is not None and structured_output_spec(request) is not None:
            raise InvalidRequestError(
                f"tool_choice {plan.choice!r} constrains the output already: it cannot be "
                "combined with response_format or structured outputs",
                param="tool_choice",
            )
        return self.sampling_params(
            request,
            max_tokens=self.max_tokens_for(prompt_len, request.requested_max_tokens),
            logprobs=_top_logprobs(request),
            prompt_logprobs=request.prompt_logprobs,
            structured_output=tool_grammar,
        )

    def grammars_to_check(
        self, request: ChatCompletionRequest, params: SamplingParams
    ) -> list[StructuredOutputSpec]:
        return super().grammars_to_check(request, params) + tool_schemas(request)

    def chunk_renderer(self, request: ChatCompletionRequest, context: ResponseContext) -> _ChatChunks:
        return _ChatChunks(self.logprobs, context, request, plan_tools(request))

    def response(
        self,
        request: ChatCompletionRequest,
        context: ResponseContext,
        finals: list[RequestOutput],
        usage: Usage,
    ) -> ChatCompletionResponse:
        (final,) = finals
        top_logprobs = _top_logprobs(request)
        plan = plan_tools(request)
        choices = []
        for choice in final.outputs:
            content, calls = (
                parse_tool_calls(plan, choice.text)
                if plan is not None and plan.parses_calls
                else (choice.text, [])
            )
            choices.append(
                ChatCompletionChoice(
                    index=choice.index,
                    message=AssistantMessage(content=content, tool_calls=calls or None),
                    logprobs=None
                    if top_logprobs is None or choice.logprobs is None
                    else self.logprobs.chat_logprobs(choice.token_ids, choice.logprobs, top_logprobs),
                    finish_reason=_finish_reason(choice, bool(calls)),
                    stop_reason=choice.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=context.request_id,
            created=context.created,
            model=context.model,
            system_fingerprint=SYSTEM_FINGERPRINT,
            choices=choices,
            usage=usage,
            prompt_logprobs=self.logprobs.prompt_logprobs(final.prompt_logprobs),
        )


def _finish_reason(choice: CompletionOutput, called: bool) -> str | None:
    """The choice's finish reason, "tool_calls" where the model stopped after calling tools."""
    return "tool_calls" if called and choice.finish_reason == "stop" else choice.finish_reason


def _top_logprobs(request: ChatCompletionRequest) -> int | None:
    """The engine's logprobs count: None without `logprobs`, else top_logprobs (0: only the sampled token)."""
    return (request.top_logprobs or 0) if request.logprobs else None


class _ChatChunks:
    """Chunks of a streamed chat completion: the role first, then content deltas, then the finish.

    With tools, each choice's text goes through its tool-call reader (ember/server/tool_call_streams.py):
    content streams as it comes until a call begins, and calls stream as the openai SDK accumulates them,
    per call a chunk with its index, id and name, then its arguments in the fragments the model produces."""

    def __init__(
        self,
        formatter: LogprobFormatter,
        context: ResponseContext,
        request: ChatCompletionRequest,
        tools: ToolPlan | None,
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
        self._tools = tools if tools is not None and tools.parses_calls else None
        self._call_streams: dict[int, ConstrainedToolCallStream | HermesToolCallStream] = {}

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
        if self._tools is not None:
            return (
                self._tool_events(index, *self._call_stream(index).feed(choice.text), self._logprobs(choice))
                or None
            )
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
        if self._tools is None:
            return self._event(self._choice(index, choice, choice.finish_reason))
        stream = self._call_stream(index)
        events = self._tool_events(index, *stream.feed(choice.text), self._logprobs(choice))
        events += self._tool_events(index, *stream.finish())
        return events + self._event(
            ChatCompletionChunkChoice(
                index=index,
                delta=DeltaMessage(),
                finish_reason=_finish_reason(choice, stream.num_calls > 0),
                stop_reason=choice.stop_reason,
            )
        )

    def _call_stream(self, index: int) -> ConstrainedToolCallStream | HermesToolCallStream:
        stream = self._call_streams.get(index)
        if stream is None:
            stream = self._call_streams[index] = tool_call_stream(self._tools)
        return stream

    def _tool_events(
        self, index: int, content: str, calls: list[DeltaToolCall], logprobs: ChatLogprobs | None = None
    ) -> bytes:
        """A content chunk (if any content), then one chunk per tool-call piece. The logprobs of the tokens
        that produced them ride on the first of these chunks, or on a chunk of their own while the text is
        held, so a stream's logprobs join to the whole response's."""
        deltas = ([DeltaMessage(content=content)] if content else []) + [
            DeltaMessage(tool_calls=[piece]) for piece in calls
        ]
        if logprobs is not None and logprobs.content and not deltas:
            deltas = [DeltaMessage()]
        return b"".join(
            self._event(
                ChatCompletionChunkChoice(index=index, delta=delta, logprobs=logprobs if not k else None)
            )
            for k, delta in enumerate(deltas)
        )

    def _logprobs(self, choice: CompletionOutput) -> ChatLogprobs | None:
        """The logprobs of the choice's new tokens, if the request asks for them."""
        if self._top_logprobs is None or choice.logprobs is None:
            return None
        return self._formatter.chat_logprobs(choice.token_ids, choice.logprobs, self._top_logprobs)

    def _choice(
        self, index: int, choice: CompletionOutput, finish_reason: str | None
    ) -> ChatCompletionChunkChoice:
        return ChatCompletionChunkChoice(
            index=index,
            delta=DeltaMessage(content=choice.text),
            logprobs=self._logprobs(choice),
            finish_reason=finish_reason,
            stop_reason=choice.stop_reason if finish_reason else None,
        )

    def usage(self, usage: Usage) -> bytes:
        return self._event(None, usage)
