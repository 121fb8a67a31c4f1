"""POST /v1/completions: a string, token ids, or a batch of either; echo, logprobs, n, streaming."""

from __future__ import annotations

from ember.engine.outputs import CompletionOutput, RequestOutput
from ember.engine.sampling_params import SamplingParams
from ember.server.logprobs import LogprobFormatter
from ember.server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    Usage,
)
from ember.server.serving import SYSTEM_FINGERPRINT, OpenAIServing, ResponseContext
from ember.server.streaming import TEXT_MARKER, TextChunkTemplate, sse_event


class CompletionsServing(OpenAIServing[CompletionRequest]):
    request_id_prefix = "cmpl"
    prompt_param = "prompt"

    def encode_prompts(self, request: CompletionRequest) -> list[list[int]]:
        prompts = request.prompts
        if not isinstance(prompts[0], str):
            return prompts
        if len(prompts) == 1:
            return [self.tokenizer.encode(prompts[0])]
        return self.tokenizer.encode_batch(prompts)

    def sampling_params_for(self, request: CompletionRequest, prompt_len: int) -> SamplingParams:
        return self.sampling_params(
            request,
            max_tokens=self.max_tokens_for(prompt_len, request.max_tokens),
            logprobs=request.logprobs,
            prompt_logprobs=request.prompt_logprobs if request.prompt_logprobs is not None
            else request.logprobs if _scores_prompt(request) else None,
        )  # fmt: skip

    def chunk_renderer(self, request: CompletionRequest, context: ResponseContext) -> _CompletionChunks:
        echo_texts = self._echo_texts(request, context.prompt_ids)
        return _CompletionChunks(self.logprobs, context, request, echo_texts)

    def response(
        self,
        request: CompletionRequest,
        context: ResponseContext,
        finals: list[RequestOutput],
        usage: Usage,
    ) -> CompletionResponse:
        echo_texts = self._echo_texts(request, context.prompt_ids)
        choices: list[CompletionResponseChoice] = []
        for prompt_index, output in enumerate(finals):
            prefix = echo_texts[prompt_index] if echo_texts else ""
            # Shared by the prompt's n choices: built once.
            prompt_logprobs = (
                self.logprobs.prompt_logprobs(output.prompt_logprobs)
                if request.prompt_logprobs is not None
                else None
            )
            for choice in output.outputs:
                logprobs = None
                if _scores_prompt(request) and choice.logprobs is not None:
                    logprobs = self.logprobs.completion_logprobs(
                        context.prompt_ids[prompt_index] + choice.token_ids,
                        output.prompt_logprobs + choice.logprobs,
                        request.logprobs,
                        0,
                    )
                elif request.logprobs is not None and choice.logprobs is not None:
                    logprobs = self.logprobs.completion_logprobs(
                        choice.token_ids, choice.logprobs, request.logprobs, len(prefix)
                    )
                choices.append(
                    CompletionResponseChoice(
                        index=prompt_index * request.n + choice.index,
                        text=prefix + choice.text,
                        logprobs=logprobs,
                        finish_reason=choice.finish_reason,
                        stop_reason=choice.stop_reason,
                        prompt_logprobs=prompt_logprobs,
                    )
                )
        return CompletionResponse(
            id=context.request_id,
            created=context.created,
            model=context.model,
            system_fingerprint=SYSTEM_FINGERPRINT,
            choices=choices,
            usage=usage,
        )

    def _echo_texts(self, request: CompletionRequest, prompt_ids: list[list[int]]) -> list[str] | None:
        """Each prompt's text as echo shows it; None without echo."""
        if not request.echo:
            return None
        prompts = request.prompts
        if isinstance(prompts[0], str):
            return list(prompts)
        return [self.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompt_ids]


def _scores_prompt(request: CompletionRequest) -> bool:
    """echo with logprobs scores the prompt too (lm-eval's loglikelihood requests, for one)."""
    return request.echo and request.logprobs is not None


class _CompletionChunks:
    """Chunks of a streamed completion; plain text deltas go through a per-choice byte template."""

    def __init__(
        self,
        formatter: LogprobFormatter,
        context: ResponseContext,
        request: CompletionRequest,
        echo_texts: list[str] | None,
    ) -> None:
        self._formatter = formatter
        self._header = dict(
            id=context.request_id,
            created=context.created,
            model=context.model,
            system_fingerprint=SYSTEM_FINGERPRINT,
        )
        self._n = request.n
        num_choices = request.n * len(context.prompt_ids)
        self._logprobs = request.logprobs
        self._echo_texts = echo_texts
        self._prompt_ids = context.prompt_ids
        self._text_offsets = [
            len(echo_texts[i // request.n]) if echo_texts else 0 for i in range(num_choices)
        ]
        self.include_usage = bool(request.stream_options and request.stream_options.include_usage)
        self._templates: dict[int, TextChunkTemplate] = {}

    def _chunk(self, choice: CompletionChoice) -> CompletionChunk:
        return CompletionChunk(**self._header, choices=[choice])

    def _event(self, chunk: CompletionChunk) -> bytes:
        return sse_event(chunk.model_dump(mode="json", exclude=None if self.include_usage else {"usage"}))

    def preamble(self, prompt_index: int, output: RequestOutput) -> list[bytes]:
        """The echoed prompt of each of the prompt's choices; with logprobs, its tokens' scores too."""
        if not self._echo_texts:
            return []
        logprobs = None
        if self._logprobs is not None and output.prompt_logprobs is not None:
            logprobs = self._formatter.completion_logprobs(
                self._prompt_ids[prompt_index], output.prompt_logprobs, self._logprobs, 0
            )
        events = []
        for index in range(prompt_index * self._n, (prompt_index + 1) * self._n):
            if logprobs is not None and logprobs.tokens:  # generated tokens' offsets follow the prompt's
                self._text_offsets[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
            text = self._echo_texts[prompt_index]
            events.append(self._event(self._chunk(
                CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=None)
            )))  # fmt: skip
        return events

    def delta(self, index: int, choice: CompletionOutput) -> bytes | None:
        if self._logprobs is None:
            if not choice.text:
                return None
            template = self._templates.get(index)
            if template is None:
                template = self._templates[index] = TextChunkTemplate(
                    self._event(
                        self._chunk(CompletionChoice(index=index, text=TEXT_MARKER, finish_reason=None))
                    )
                )
            return template.render(choice.text)
        if not choice.token_ids:
            return None
        return self._event(self._chunk(self._choice(index, choice, None)))

    def final(self, index: int, choice: CompletionOutput) -> bytes:
        return self._event(self._chunk(self._choice(index, choice, choice.finish_reason)))

    def _choice(self, index: int, choice: CompletionOutput, finish_reason: str | None) -> CompletionChoice:
        logprobs = None
        if self._logprobs is not None and choice.logprobs is not None:
            logprobs = self._formatter.completion_logprobs(
                choice.token_ids, choice.logprobs, self._logprobs, self._text_offsets[index]
            )
            if logprobs.tokens:
                self._text_offsets[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        return CompletionChoice(
            index=index,
            text=choice.text,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=choice.stop_reason if finish_reason else None,
        )

    def usage(self, usage: Usage) -> bytes:
        return self._event(CompletionChunk(**self._header, choices=[], usage=usage))
