"""Tool calls read out of a choice's text as it is generated, in OpenAI's streamed shape: per call a piece with
its index, id and name as soon as the name is complete, then its arguments' text in the fragments the model
produces. The whole (non-streamed) response reads its text through the same readers, so a stream
accumulates to exactly the calls of the whole response, however the text was split into chunks.

Both readers take the text piece by piece: `feed(text)` returns the content and the call pieces that text
completes, `finish()` what the end of the text settles."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable

from ember.server.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall

# A call of the "required" grammar's JSON array, which fixes the spacing.
_CONSTRAINED_HEADER = re.compile(r'\{"name": "((?:[^"\\]|\\.)*)", "arguments": ')
# The Hermes/Qwen block a model writes unconstrained: <tool_call>{"name": "...", "arguments": {...}}</tool_call>,
# with any spacing, and "parameters" for "arguments" as some models write it.
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_HERMES_HEADER = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def accumulate_calls(pieces: Iterable[DeltaToolCall]) -> list[ToolCall]:
    """The whole calls that the pieces make up, as the openai SDK's stream helpers join them."""
    calls: dict[int, ToolCall] = {}
    for piece in pieces:
        call = calls.get(piece.index)
        if call is None:
            call = calls[piece.index] = ToolCall(
                id=piece.id or new_call_id(),
                function=FunctionCall(name=piece.function.name or "", arguments=""),
            )
        call.function.arguments += piece.function.arguments or ""
    return [calls[index] for index in sorted(calls)]


class _JsonValueEnd:
    """Where a JSON object or array ends, reading its text piece by piece from its opening bracket."""

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def scan(self, text: str, pos: int) -> tuple[int, bool]:
        """How far the value goes in text[pos:], and whether its closing bracket is there."""
        while pos < len(text):
            char = text[pos]
            pos += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return pos, True
        return pos, False


class _CallPieces:
    def __init__(self) -> None:
        self.num_calls = 0

    def _header(self, name: str) -> DeltaToolCall:
        self.num_calls += 1
        return DeltaToolCall(
            index=self.num_calls - 1,
            id=new_call_id(),
            type="function",
            function=DeltaFunctionCall(name=name, arguments=""),
        )

    def _fragment(self, text: str) -> DeltaToolCall:
        return DeltaToolCall(index=self.num_calls - 1, function=DeltaFunctionCall(arguments=text))


class ConstrainedToolCallStream(_CallPieces):
    """The calls of a choice decoded under a tool grammar: tool_choice "required" (a JSON array of
    {"name", "arguments"} objects) or a named function (the whole text is its arguments). The grammar fixes
    the text's shape, so there is never content."""

    def __init__(self, named: str | None) -> None:
        super().__init__()
        self._named = named
        self._text = ""
        self._pos = 0  # how far the text is consumed
        self._arguments: _JsonValueEnd | None = None  # inside a call's arguments

    def feed(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        if self._named is not None:
            pieces = [] if self.num_calls else [self._header(self._named)]
            return "", pieces + ([self._fragment(text)] if text else [])
        self._text += text
        pieces = []
        while True:
            if self._arguments is None:
                header = _CONSTRAINED_HEADER.search(self._text, self._pos)
                if header is None:
                    return "", pieces
                pieces.append(self._header(json.loads(f'"{header.group(1)}"')))
                self._pos = header.end()
                self._arguments = _JsonValueEnd()
            start = self._pos
            self._pos, done = self._arguments.scan(self._text, self._pos)
            if self._pos > start:
                pieces.append(self._fragment(self._text[start : self._pos]))
            if not done:
                return "", pieces
            self._arguments = None

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        return "", []


class HermesToolCallStream(_CallPieces):
    """tool_choice "auto": the model answers in text or writes <tool_call> blocks. The text before the first
    block is content, sent as it comes except a tail that may begin "<tool_call>" and trailing whitespace
    (the content of a message with calls is the text before them, stripped at its end). A block's call
    starts as soon as its name is read and is one of the tools; its arguments are the model's text as written
    (OpenAI's are too: the caller validates them). A block in another shape (keys in another order) is read
    whole when it closes. Text between and after blocks, blocks naming no tool and the calls past
    `max_calls` (1 without parallel_tool_calls) are dropped; if no block is a call, the whole text is
    content."""

    def __init__(self, names: Iterable[str], max_calls: int | None = None) -> None:
        super().__init__()
        self._names = frozenset(names)
        self._max_calls = max_calls
        self._text = ""
        self._pos = 0  # how far the text is consumed
        self._unsent = 0  # where the text not sent as content starts
        self._state = "content"  # content | block | arguments | after_block | between_blocks
        self._arguments = _JsonValueEnd()

    def feed(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        self._text += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        content, pieces = self._advance(final=True)
        if self.num_calls == 0:  # "<tool_call>" led to no call: the text held since is content after all
            content += self._text[self._unsent :]
            self._unsent = len(self._text)
        return content, pieces

    def _advance(self, final: bool) -> tuple[str, list[DeltaToolCall]]:
        text = self._text
        content = ""
        pieces: list[DeltaToolCall] = []
        while True:
            if self._state == "content":
                found = text.find(_OPEN, self._pos)
                if found < 0:
                    end = len(text) if final else _content_end(text, self._pos)
                    content += text[self._pos : end]
                    self._pos = self._unsent = end
                    return content, pieces
                end = self._pos + len(text[self._pos : found].rstrip())
                content += text[self._pos : end]
                self._unsent = end
                self._pos = found + len(_OPEN)
                self._state = "block"
            elif self._state == "block":
                header = _HERMES_HEADER.match(text, self._pos)
                close = text.find(_CLOSE, self._pos)
                if header is not None and (close < 0 or header.end() < close):
                    name = _json_string(header.group(1))
                    if name in self._names:
                        pieces.append(self._header(name))
                        self._pos = header.end()
                        self._arguments = _JsonValueEnd()
                        self._state = "arguments"
                    else:
                        self._state = "after_block"
                elif close >= 0 or final:
                    end = close if close >= 0 else len(text)
                    call = _whole_call(text[self._pos : end], self._names)
                    if call is not None:
                        pieces += [self._header(call[0]), self._fragment(call[1])]
                    self._pos = end
                    self._state = "after_block"
                else:
                    return content, pieces
            elif self._state == "arguments":
                start = self._pos
                self._pos, done = self._arguments.scan(text, self._pos)
                if self._pos > start:
                    pieces.append(self._fragment(text[start : self._pos]))
                if not done:
                    return content, pieces
                self._state = "after_block"
            else:  # after_block, between_blocks: skip to the next block
                after_block = self._state == "after_block"
                if not after_block and self.num_calls == self._max_calls:
                    return content, pieces
                mark = _CLOSE if after_block else _OPEN
                found = text.find(mark, self._pos)
                if found < 0:  # the next search starts where the mark may begin
                    self._pos = max(self._pos, len(text) - len(mark) + 1)
                    return content, pieces
                self._pos = found + len(mark)
                self._state = "between_blocks" if after_block else "block"


def _content_end(text: str, start: int) -> int:
    """How much of text[start:] can go out as content before the rest of the text is known: not a tail that
    may be the beginning of "<tool_call>", nor whitespace that may end up before one."""
    end = len(text)
    for size in range(min(len(_OPEN) - 1, end - start), 0, -1):
        if _OPEN.startswith(text[end - size :]):
            end -= size
            break
    while end > start and text[end - 1].isspace():
        end -= 1
    return end


def _json_string(body: str) -> str | None:
    try:
        return json.loads(f'"{body}"')
    except ValueError:
        return None


def _whole_call(block: str, names: frozenset[str]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a whole block in any key order, or None if it is not a call of a tool."""
    try:
        call = json.loads(block)
    except ValueError:
        return None
    if not isinstance(call, dict):
        return None
    arguments = call.get("arguments", call.get("parameters"))
    if call.get("name") not in names or not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)
