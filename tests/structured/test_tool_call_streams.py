"""The tool-call readers on their own: however a choice's text is split into chunks, the content and the calls
come out the same as from the whole text, content goes out as soon as it cannot be the start of a call, and a
call's id and name come before its argument fragments."""

from __future__ import annotations

import json
import random

from ember.server.tool_call_streams import ConstrainedToolCallStream, HermesToolCallStream, accumulate_calls

NAMES = ["get_weather", "add"]
TWO_CALLS = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo \\"}{\\" town", '
    '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2]}}\n</tool_call>'
)


def read(stream, chunks: list[str]) -> tuple[str, list[tuple[str, str]], list]:
    """(content, [(name, arguments)], every piece in order) from feeding `chunks` and finishing."""
    content, pieces = "", []
    for chunk in chunks:
        text, more = stream.feed(chunk)
        content, pieces = content + text, pieces + more
    text, more = stream.finish()
    calls = accumulate_calls(pieces + more)
    return content + text, [(call.function.name, call.function.arguments) for call in calls], pieces + more


def splits(text: str, seed: int) -> list[list[str]]:
    """The text whole, a character at a time, and in random pieces."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(12, len(text) - 1)))
    pieces = [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    return [[text], list(text), pieces]


def test_hermes_calls_are_the_same_however_the_text_is_split():
    expected_calls = [
        ("get_weather", '{"city": "Oslo \\"}{\\" town", "unit": "celsius"}'),
        ("add", '{"a": 1, "b": [2]}'),
    ]
    for seed in range(5):
        for chunks in splits(TWO_CALLS, seed):
            content, calls, pieces = read(HermesToolCallStream(NAMES), chunks)
            assert (content, calls) == ("Let me check.", expected_calls), chunks
            assert [json.loads(arguments) for _, arguments in calls][1] == {"a": 1, "b": [2]}
            # Per call: first a piece with its id and name, then fragments only.
            assert [piece.id is not None for piece in pieces if piece.index == 0][0] is True
            assert all(
                piece.id is None and piece.function.name is None for piece in pieces[1:] if piece.index == 0
            )


def test_hermes_without_parallel_tool_calls_keeps_the_first_call():
    for chunks in splits(TWO_CALLS, 4):
        content, calls, _ = read(HermesToolCallStream(NAMES, max_calls=1), chunks)
        assert (content, [name for name, _ in calls]) == ("Let me check.", ["get_weather"])


def test_hermes_content_goes_out_before_the_call_and_the_call_while_it_is_written():
    stream = HermesToolCallStream(NAMES)
    assert stream.feed("Let me") == ("Let me", [])
    # A newline and "<tool" may begin a block: held.
    assert stream.feed(" check.\n<tool") == (" check.", [])
    content, pieces = stream.feed('_call>\n{"name": "add", "arguments": {"a": 1')
    assert content == "" and [(p.index, p.function.name, p.function.arguments) for p in pieces] == [
        (0, "add", ""),
        (0, None, '{"a": 1'),
    ]
    content, pieces = stream.feed(', "b": 2}}\n</tool_call>')
    assert content == "" and [p.function.arguments for p in pieces] == [', "b": 2}']
    assert stream.finish() == ("", [])
    assert stream.num_calls == 1


def test_hermes_plain_answers_stay_content():
    for text in ("Hello there!\n\n", "a < b, and <tool is a word", "See <tool_call> nonsense", ""):
        for chunks in splits(text, 1) if len(text) > 1 else [[text]]:
            content, calls, _ = read(HermesToolCallStream(NAMES), chunks)
            assert (content, calls) == (text, []), chunks
    # A block naming no tool is not a call: with no other block, the whole text is content.
    unknown = 'Sure.<tool_call>{"name": "rm", "arguments": {}}</tool_call>'
    assert read(HermesToolCallStream(NAMES), list(unknown))[:2] == (unknown, [])


def test_hermes_blocks_in_other_shapes_are_read_whole_and_unknown_ones_dropped():
    text = (
        '<tool_call>{"arguments": {"a": 5, "b": 6}, "name": "add"}</tool_call>'
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'
        '<tool_call>\n{"name": "get_weather", "parameters": {"city": "Rome"}}'  # cut short: no closing tag
    )
    for chunks in splits(text, 2):
        content, calls, _ = read(HermesToolCallStream(NAMES), chunks)
        assert (content, calls) == ("", [("add", '{"a": 5, "b": 6}'), ("get_weather", '{"city": "Rome"}')])


def test_constrained_required_and_named_calls_are_the_same_however_the_text_is_split():
    required = '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": {"city": "}"}}]'
    for chunks in splits(required, 3):
        assert read(ConstrainedToolCallStream(None), chunks)[:2] == (
            "",
            [("add", '{"a": 1, "b": 2}'), ("get_weather", '{"city": "}"}')],
        )
        assert read(ConstrainedToolCallStream("add"), chunks)[:2] == ("", [("add", required)])
