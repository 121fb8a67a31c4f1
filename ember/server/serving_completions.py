"""POST /v1/completions: a string, token ids, or a batch of either; echo, logprobs, n, streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ember.engine.outputs import CompletionOutput, RequestOutput
from ember.server.middleware import access_record
from ember.server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
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


class CompletionsServing(OpenAIServing):
    async def create(self, request: CompletionRequest, raw_request: Request) -> Response:
        model = self.served_model(request.model)
        # echo with logprobs scores the prompt too (lm-eval's loglikelihood requests, for one).
        score_prompt = request.echo and request.logprobs is not None
        prompts = request.prompts
        if isinstance(prompts[0], str):
            prompt_ids = (
                self.tokenizer.encode_batch(prompts)
                if len(prompts) > 1
                else [self.tokenizer.encode(prompts[0])]
            )
        else:
            prompt_ids = prompts
        for ids in prompt_ids:
            self.engine.check_prompt(ids, "prompt")
        streaming = request.stream
        params = [
            self.sampling_params(
                request,
                max_tokens=self.max_tokens_for(len(ids), request.max_tokens),
                logprobs=request.logprobs,
                streaming=streaming,
                prompt_logprobs=request.prompt_logprobs if request.prompt_logprobs is not None
                else request.logprobs if score_prompt else None,
            )
            for ids in prompt_ids
        ]
        prompt_lens = [len(ids) for ids in prompt_ids]
        ticket = self.admit(len(prompt_ids), sum(prompt_lens))
        request_id = self.new_request_id("cmpl")
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
        echo_texts = self._echo_texts(prompts, prompt_ids) if request.echo else None
        max_tokens = params[0].max_tokens
        try:
            if streaming:
                first = await until_disconnected(raw_request, anext(merged))
            else:
                finals = await until_disconnected(raw_request, _collect(merged, len(prompt_ids)))
        except BaseException as exc:
            await merged.aclose()
            ticket.release()
            if isinstance(exc, ClientDisconnected):
                return disconnected_response()
            raise
        created = unix_time()
        if streaming:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            renderer = _CompletionChunks(
                self, request_id, created, model, request, echo_texts, prompt_ids, include_usage
            )
            body = self.stream_events(first, merged, renderer, record, prompt_lens, max_tokens, request.n)
            return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)

        choices: list[CompletionResponseChoice] = []
        generated = []
        for prompt_index, output in enumerate(finals):
            generated.append(sum(len(choice.token_ids) for choice in output.outputs))
            prefix = echo_texts[prompt_index] if echo_texts else ""
            # Shared by the prompt's n choices: built once.
            prompt_logprobs = (
                self.prompt_logprobs(output.prompt_logprobs) if request.prompt_logprobs is not None else None
            )
            for choice in output.outputs:
                logprobs = None
                if score_prompt and choice.logprobs is not None:
                    logprobs = self.completion_logprobs(
                        prompt_ids[prompt_index] + choice.token_ids,
                        output.prompt_logprobs + choice.logprobs,
                        request.logprobs,
                        0,
                    )
                elif request.logprobs is not None and choice.logprobs is not None:
                    logprobs = self.completion_logprobs(
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
        usage = self.record_finished(record, finals, prompt_lens, generated, max_tokens, request.n)
        response = CompletionResponse(
            id=request_id,
            created=created,
            model=model,
            system_fingerprint=SYSTEM_FINGERPRINT,
            choices=choices,
            usage=usage,
        )
        return json_response(response)

    def _echo_texts(self, prompts: list[Any], prompt_ids: list[list[int]]) -> list[str]:
        if isinstance(prompts[0], str):
            return list(prompts)
        return [self.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompt_ids]


async def _collect(merged: AsyncIterator[tuple[int, RequestOutput]], num_prompts: int) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * num_prompts
    async for prompt_index, output in merged:
        finals[prompt_index] = output
    return finals


class _CompletionChunks:
    """Chunks of a streamed completion; plain text deltas go through a per-choice byte template."""

    def __init__(
        self,
        serving: CompletionsServing,
        request_id: str,
        created: int,
        model: str,
        request: CompletionRequest,
        echo_texts: list[str] | None,
        prompt_ids: list[list[int]],
        include_usage: bool,
    ) -> None:
        self._serving = serving
        self._header = dict(
            id=request_id, created=created, model=model, system_fingerprint=SYSTEM_FINGERPRINT
        )
        self._n = request.n
        num_choices = request.n * (len(echo_texts) if echo_texts else len(request.prompts))
        self._logprobs = request.logprobs
        self._echo_texts = echo_texts
        self._prompt_ids = prompt_ids
        self._text_offsets = [
            len(echo_texts[i // request.n]) if echo_texts else 0 for i in range(num_choices)
        ]
        self.include_usage = include_usage
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
            logprobs = self._serving.completion_logprobs(
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
            logprobs = self._serving.completion_logprobs(
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
