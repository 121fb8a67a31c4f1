"""Workloads: exact token lengths under the served model's tokenizer, shared prefixes, sessions, ShareGPT."""

from __future__ import annotations

import json
import random

import pytest

from ember.bench.datasets import (
    LengthRange,
    PromptGenerator,
    multi_turn_dataset,
    random_dataset,
    shared_prefix_dataset,
    sharegpt_dataset,
)
from ember.bench.tokenizer import load_bench_tokenizer
from ember.errors import EmberError


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_bench_tokenizer(str(tiny_model_dir))


def test_random_prompts_have_exact_token_lengths(tokenizer):
    conversations = random_dataset(tokenizer, 40, LengthRange(1, 600), LengthRange(3, 9), seed=5)
    lengths = [c.turns[0].prompt_len for c in conversations]
    assert len(set(lengths)) > 30  # drawn across the range, not one length
    for conversation in conversations:
        [turn] = conversation.turns
        assert len(tokenizer.encode(turn.text)) == turn.prompt_len
        assert 1 <= turn.prompt_len <= 600 and 3 <= turn.output_len <= 9
    again = random_dataset(tokenizer, 40, LengthRange(1, 600), LengthRange(3, 9), seed=5)
    assert again == conversations
    fresh = random_dataset(tokenizer, 40, LengthRange(1, 600), LengthRange(3, 9), seed=6)
    assert {c.turns[0].text for c in fresh}.isdisjoint({c.turns[0].text for c in conversations})


def test_fixed_lengths(tokenizer):
    generator = PromptGenerator(tokenizer, random.Random(0))
    for n in (1, 2, 3, 200, 256, 1000):
        assert len(tokenizer.encode(generator.text(n))) == n


def test_shared_prefix_keeps_the_prefix_tokens(tokenizer):
    conversations = shared_prefix_dataset(tokenizer, 12, num_groups=3, prefix_len=64,
                                          input_len=LengthRange(5, 20), output_len=LengthRange(4, 4), seed=0)
    encoded = [tokenizer.encode(c.turns[0].text) for c in conversations]
    prefixes = {tuple(ids[:64]) for ids in encoded}
    assert len(prefixes) == 3  # three groups, each prefix tokenized identically in all its requests
    for ids, conversation in zip(encoded, conversations, strict=True):
        assert 64 + 5 <= len(ids) == conversation.turns[0].prompt_len <= 64 + 20
    with pytest.raises(EmberError, match="--num-groups"):
        shared_prefix_dataset(tokenizer, 2, 0, 8, LengthRange(1, 1), LengthRange(1, 1), seed=0)


def test_multi_turn_sessions(tokenizer):
    sessions = multi_turn_dataset(tokenizer, 3, turns=4, input_len=LengthRange(10, 10),
                                  output_len=LengthRange(5, 5), seed=0)
    assert [len(s.turns) for s in sessions] == [4, 4, 4]
    assert all(len(tokenizer.encode(t.text)) == 10 for s in sessions for t in s.turns)


def test_sharegpt_file(tokenizer, tmp_path):
    long_reply = " ".join(["word"] * 30)
    records = [
        {"id": "a", "conversations": [{"from": "human", "value": "Tell me a story about a cat please."},
                                      {"from": "gpt", "value": long_reply}]},
        {"id": "b", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "only one turn"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records))
    [conversation] = sharegpt_dataset(tokenizer, path, num_prompts=10, seed=0)  # "hi" is too short
    turn = conversation.turns[0]
    assert turn.text == "Tell me a story about a cat please."
    assert turn.prompt_len == len(tokenizer.encode(turn.text))
    assert turn.output_len == len(tokenizer.encode(long_reply, add_special_tokens=False))
    with pytest.raises(EmberError, match="ShareGPT_V3_unfiltered_cleaned_split.json"):
        sharegpt_dataset(tokenizer, tmp_path / "missing.json", 1, 0)


def test_length_range_parsing():
    assert LengthRange.parse("256", "--input-len") == LengthRange(256, 256)
    assert LengthRange.parse("64:512", "--input-len") == LengthRange(64, 512)
    for bad in ("0", "5:4", "a:b", "1:2:3"):
        with pytest.raises(EmberError, match="--input-len"):
            LengthRange.parse(bad, "--input-len")
