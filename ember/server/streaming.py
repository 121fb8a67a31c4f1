"""Server-sent events: one `data: {json}` event per chunk, `data: [DONE]` at the end (framing in ember/sse.py).

stream_events assembles a streamed response from the engine's outputs; each endpoint shapes its chunks
through a ChunkRenderer. Per generated token the stream only changes the chunk's text, so a renderer
encodes the chunk once per request and choice (TextChunkTemplate), split around a marker, and each token
costs one `orjson.dumps(text)` and a concatenation instead of building and serializing a pydantic model."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import orjson
from pydantic import BaseModel

from ember.engine.outputs import CompletionOutput, RequestOutput
from ember.server.errors import APIError
from ember.server.protocol import Usage
from ember.sse import DONE_EVENT, data_event

# A string no tokenizer produces; put it where the text goes when building a template's chunk.
TEXT_MARKER = "\x00ember-text\x00"
_ENCODED_MARKER = orjson.dumps(TEXT_MARKER)


def sse_event(payload: BaseModel | dict[str, Any]) -> bytes:
    if isinstance(payload, BaseModel):
        payload = payload.model_dump(mode="json")
    return data_event(orjson.dumps(payload))


class TextChunkTemplate:
    """The SSE bytes of one chunk whose only varying field is a text string."""

    __slots__ = ("_head", "_tail")

    def __init__(self, encoded: bytes) -> None:
        """`encoded`: the chunk's SSE event with TEXT_MARKER as the text."""
        head, sep, tail = encoded.partition(_ENCODED_MARKER)
        if not sep or _ENCODED_MARKER in tail:
            raise ValueError("the chunk must hold the text marker exactly once")
        self._head = head
        self._tail = tail

    def render(self, text: str) -> bytes:
        return self._head + orjson.dumps(text) + self._tail


class ChunkRenderer(Protocol):
    """How one endpoint shapes its stream's chunks; `index` is the choice index in the response."""

    include_usage: bool

    def preamble(self, prompt_index: int, output: RequestOutput) -> list[bytes]:
        """Chunks that open one prompt's choices, sent before its first output's (which is `output`)."""
        ...

    def delta(self, index: int, choice: CompletionOutput) -> bytes | None: ...

    def final(self, index: int, choice: CompletionOutput) -> bytes: ...

    def usage(self, usage: Usage) -> bytes: ...


async def stream_events(
    first: tuple[int, RequestOutput],
    merged: AsyncIterator[tuple[int, RequestOutput]],
    renderer: ChunkRenderer,
    *,
    num_prompts: int,
    n: int,
    observe_itl: Callable[[float], None],
    finish: Callable[[list[RequestOutput], list[int]], Usage],
    abandon: Callable[[list[int]], None],
) -> AsyncIterator[bytes]:
    """The SSE body: the renderer's chunks for each (prompt index, engine output), the usage chunk, [DONE].

    Engine outputs are deltas and list every choice each time; a choice already finished is skipped.
    `finish(final outputs, tokens generated per prompt)` records the finished request and returns its
    usage; `abandon(tokens generated per prompt)` is called instead when the stream ends early (client
    gone, error)."""
    finals: list[RequestOutput | None] = [None] * num_prompts
    generated = [0] * num_prompts
    last_token_time: list[float | None] = [None] * num_prompts
    done: set[int] = set()
    opened: set[int] = set()
    finished = False
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
                observe_itl(now - previous)
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
        usage = finish(finals, generated)
        finished = True
        if renderer.include_usage:
            yield renderer.usage(usage)
        yield DONE_EVENT
    except APIError as exc:  # the status line is sent already: report in-band, as vLLM does
        yield sse_event(exc.body())
        yield DONE_EVENT
    finally:
        if not finished:
            abandon(generated)
        await merged.aclose()
