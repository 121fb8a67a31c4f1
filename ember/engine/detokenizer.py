"""Incremental detokenization with stop strings.

Text grows one token at a time through tokenizers' DecodeStream, which never splits a multi-byte
UTF-8 character (it waits for the bytes that complete it). Stop strings are matched on the text, so
they are found across token boundaries; text that could still turn into a stop string is held back
until it cannot (or the sequence finishes)."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from ember.engine.sampling_params import SamplingParams
from ember.loader.tokenizer import Tokenizer

# Prompt tokens the stream is primed with, so the first output token decodes as a continuation.
PRIME_TOKENS = 8


class IncrementalDetokenizer:
    __slots__ = ("_tokenizer", "_stream", "_stops", "_max_stop_len", "_include_stop", "_min_tokens",
                 "text", "num_output_tokens", "finished")

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer.hf_tokenizer
        self._stream = DecodeStream(ids=prompt_token_ids[-PRIME_TOKENS:],
                                    skip_special_tokens=params.skip_special_tokens)
        self._stops = params.stop_strings
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self.text = ""
        self.num_output_tokens = 0
        self.finished = False

    def update(self, token_id: int, decode: bool = True) -> str | None:
        """Add one generated token; returns the stop string it completed, if any.

        `decode=False` counts the token without adding its text (a stop token that is not shown)."""
        self.num_output_tokens += 1
        if not decode:
            return None
        piece = self._stream.step(self._tokenizer, token_id)
        if not piece:
            return None
        start = len(self.text)
        self.text += piece
        if not self._stops or self.num_output_tokens < self._min_tokens:
            return None
        return self._match_stop(max(0, start - self._max_stop_len + 1))

    def _match_stop(self, search_from: int) -> str | None:
        text = self.text
        best_pos, best = -1, None
        for stop in self._stops:
            pos = text.find(stop, search_from)
            if pos != -1 and (best is None or pos < best_pos):
                best_pos, best = pos, stop
        if best is None:
            return None
        self.text = text[: best_pos + len(best)] if self._include_stop else text[:best_pos]
        self.finished = True
        return best

    def visible_text(self) -> str:
        """The text that may be shown now: everything but a tail that could still begin a stop string."""
        text = self.text
        if self.finished or self._include_stop or not self._stops:
            return text
        for hold in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            tail = text[-hold:]
            if any(stop.startswith(tail) for stop in self._stops):
                return text[:-hold]
        return text

    def finish(self) -> None:
        """The sequence ended: release any held-back text."""
        self.finished = True


def decode_token(tokenizer: Tokenizer, token_id: int, cache: dict[int, str]) -> str:
    """The text of one token on its own, as logprobs report it."""
    text = cache.get(token_id)
    if text is None:
        text = cache[token_id] = tokenizer.hf_tokenizer.decode([token_id], skip_special_tokens=False)
    return text
