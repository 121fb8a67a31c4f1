"""Wire format of the OpenAI-compatible API (request and response bodies), as pydantic models.

Field names and defaults follow OpenAI's API; vLLM's extra sampling fields (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, priority, ...) are accepted as vLLM accepts them.
Unknown fields are ignored, as vLLM does, so clients that send newer OpenAI fields keep working."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_serializer, model_validator

# OpenAI caps top_logprobs at 20; completions' logprobs at 5, vLLM allows up to 20 for both.
MAX_LOGPROBS = 20
MAX_N = 128

NonNegativeInt = Annotated[int, Field(ge=0)]


def _encodable(text: str) -> str:
    # JSON may escape a lone surrogate ("\\ud800"): Python keeps it, no tokenizer can encode it.
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (it holds a lone surrogate)") from None
    return text


# Text that reaches the tokenizer (prompts, message contents and names).
Text = Annotated[str, AfterValidator(_encodable)]


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema: OpenAI's named schema (`strict` is accepted; decoding is always strict)."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs` object: exactly one constraint."""

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions. NaN and infinities are refused
    (Python's json module reads them) before any range check could misreport them."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    seed: int | None = Field(
        None, ge=-(2**63), le=2**63 - 1 - MAX_N
    )  # torch generator range, plus n siblings
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegativeInt] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    priority: int = 0
    user: str | None = None
    # vLLM's extra: each prompt token's logprob, rank and this many top alternatives (not when streaming).
    prompt_logprobs: int | None = Field(None, ge=0)
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _check_unsupported(self) -> SamplingFields:
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream is true")
        return self


class TextContentPart(BaseModel):
    type: Literal["text"]
    text: Text


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as a string


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn's answer to this call

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


Prompt = Text | list[Text] | list[NonNegativeInt] | list[list[NonNegativeInt]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for /v1/completions
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be an empty list")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(
                "best_of is not supported (only best_of == n, which is the same as leaving it out)"
            )
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        """The prompt as a batch: a list of strings or a list of token-id lists."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], int):
            return [prompt]  # type: ignore[list-item]
        return prompt  # type: ignore[return-value]


# ---- responses -------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One token's entry in vLLM's prompt_logprobs (keyed by token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]


class _OmitsAbsentToolCalls(BaseModel):
    """OpenAI leaves tool_calls out of a message without calls."""

    @model_serializer(mode="wrap")
    def _omit_absent_tool_calls(self, handler) -> dict[str, Any]:
        data = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class AssistantMessage(_OmitsAbsentToolCalls):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str
    choices: list[ChatCompletionChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # with the request's prompt_logprobs, as vLLM


class _OmitsNone(BaseModel):
    """OpenAI's stream leaves a tool-call piece's absent fields out: after a call's first piece, a null
    `type` would replace the call's in the openai SDK's stream helpers (which take `type` as given)."""

    @model_serializer(mode="wrap")
    def _omit_none(self, handler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunctionCall(_OmitsNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_OmitsNone):
    """One piece of a streamed tool call: index, id, type and name first, then argument fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_OmitsAbsentToolCalls):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatCompletionChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None


class CompletionResponseChoice(CompletionChoice):
    prompt_logprobs: PromptLogprobs | None = None  # with the request's prompt_logprobs, as vLLM


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str
    choices: list[CompletionResponseChoice]
    usage: Usage


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ---- other endpoints ---------------------------------------------------------------------------------


class EmberModelInfo(BaseModel):
    """How Ember runs the model here: the dtype and why, and the code each part of a step runs on
    (ember/kernels/native.py's kernel_paths)."""

    dtype: str
    dtype_reason: str
    kernel_level: str  # the ISA level the native kernels were built for; "none" without them
    kernels: dict[str, str]
    kv_cache_dtype: str  # the model's dtype, or int8 (--kv-cache-dtype)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ember"
    root: str
    parent: str | None = None
    max_model_len: int
    ember: EmberModelInfo


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None  # rendered into the messages' prompt, as a chat request's are
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str]


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[NonNegativeInt]


class DetokenizeResponse(BaseModel):
    prompt: str
