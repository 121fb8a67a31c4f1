"""Incremental detokenizer on the real SmolLM2 tokenizer: UTF-8 safety, stop strings across tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import tokenizers

from ember.engine.detokenizer import IncrementalDetokenizer
from ember.engine.sampling_params import SamplingParams
from ember.loader.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer(tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")), eos_token_ids=[2])


def stream(tokenizer: Tokenizer, prompt: str, output: str, params: SamplingParams):
    """Feed `output`'s tokens one at a time; return the detokenizer, the visible text after each token
    and the stop string that ended it (if any)."""
    prompt_ids = tokenizer.encode(prompt)
    output_ids = tokenizer.encode(output, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    visible, stop = [], None
    for token_id in output_ids:
        stop = detok.update(token_id)
        visible.append(detok.visible_text())
        if stop is not None:
            break
    return detok, visible, stop, output_ids


def test_streamed_text_never_splits_a_character_and_equals_the_full_decode(tokenizer):
    output = "naïve café — 你好世界 🎉🚀 ok ∑∫ done"
    detok, visible, stop, output_ids = stream(tokenizer, "Say:", output, SamplingParams())
    assert stop is None
    # Several tokens of this text are partial UTF-8 bytes of one character.
    assert any("\ufffd" in tokenizer.decode([t]) for t in output_ids)
    assert all("\ufffd" not in text for text in visible)
    assert all(later.startswith(earlier) for earlier, later in zip(visible, visible[1:], strict=False))
    detok.finish()
    assert detok.visible_text() == tokenizer.decode(output_ids) == output


def test_stop_string_across_token_boundaries_is_cut_and_held_back(tokenizer):
    params = SamplingParams(stop=["STOP here"])
    detok, visible, stop, output_ids = stream(tokenizer, "x", "one two STOP here three", params)
    assert stop == "STOP here"
    assert detok.visible_text() == "one two "
    # The stop string spans several tokens, and no partial stop text was ever visible.
    assert len(output_ids) > 4
    assert all("STOP"[:2] not in text for text in visible)
    assert all(later.startswith(earlier) for earlier, later in zip(visible, visible[1:], strict=False))


def test_include_stop_str_in_output_keeps_the_stop_text(tokenizer):
    params = SamplingParams(stop=["two"], include_stop_str_in_output=True)
    detok, _, stop, _ = stream(tokenizer, "x", "one two three", params)
    assert stop == "two"
    assert detok.visible_text() == "one two"


def test_earliest_stop_string_wins_and_held_text_is_released_at_finish(tokenizer):
    params = SamplingParams(stop=["three", "wo"])
    detok, _, stop, _ = stream(tokenizer, "x", "one two three", params)
    assert (stop, detok.visible_text()) == ("wo", "one t")
    params = SamplingParams(stop=["endless"])
    detok, visible, stop, _ = stream(tokenizer, "x", "it has no end", params)
    assert stop is None and visible[-1] == "it has no "
    detok.finish()
    assert detok.visible_text() == "it has no end"


def test_stop_strings_wait_for_min_tokens(tokenizer):
    ids = tokenizer.encode("ab ab ab", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["ab"], min_tokens=3))
    stops = [detok.update(token_id) for token_id in ids]
    assert stops.index("ab") == 2


def test_hidden_stop_token_adds_no_text(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(skip_special_tokens=False))
    for token_id in tokenizer.encode("hi", add_special_tokens=False):
        detok.update(token_id)
    detok.update(2, decode=False)
    assert detok.visible_text() == "hi" and detok.num_output_tokens == 2
