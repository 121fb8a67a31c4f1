"""Server-sent events: one `data: {json}` event per chunk (framing in ember/sse.py).

Per generated token the stream only changes the chunk's text, so the chunk is encoded once per
request and choice, split around a marker, and each token costs one `orjson.dumps(text)` and a
concatenation instead of building and serializing a pydantic model."""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel

from ember.sse import data_event

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
