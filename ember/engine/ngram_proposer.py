"""Draft tokens for speculative decoding by prompt lookup (vLLM's "ngram" method).

The last n tokens of a sequence (n from prompt_lookup_max down to prompt_lookup_min) are looked up
earlier in the same sequence, prompt and output alike; the tokens that followed the most recent match
are the draft. No second model runs: drafting is a byte search, a few microseconds per sequence.
Drafts pay off where text repeats itself (code edits, quoting the prompt, extraction, degenerate
greedy loops); where nothing matches, the sequence simply decodes one token."""

from __future__ import annotations

from array import array

_ITEM = array("i").itemsize


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to min(num_speculative_tokens, max_tokens) tokens that followed the longest, most recent
        earlier occurrence of the sequence's suffix; [] when the suffix never occurred before."""
        k = min(self.num_speculative_tokens, max_tokens)
        length = len(token_ids)
        if k <= 0 or length <= self.prompt_lookup_min:
            return []
        # bytes.rfind runs the search in C; a hit at an offset that is not a whole token is skipped.
        haystack = array("i", token_ids).tobytes()
        for n in range(min(self.prompt_lookup_max, length - 1), self.prompt_lookup_min - 1, -1):
            needle = haystack[(length - n) * _ITEM :]
            end = (length - 1) * _ITEM  # a match must end before the suffix's last token
            while (found := haystack.rfind(needle, 0, end)) >= 0:
                if found % _ITEM == 0:
                    return _copy_forward(token_ids, found // _ITEM + n, k)
                end = found + len(needle) - 1
        return []


def _copy_forward(token_ids: list[int], start: int, k: int) -> list[int]:
    """k tokens continuing token_ids from `start`, as an LZ77 copy: where the copy runs past the end it
    goes on from its own first tokens, so a sequence repeating with period p drafts k tokens, not just p."""
    draft = token_ids[start : start + k]
    period = len(token_ids) - start
    while len(draft) < k:
        draft.append(draft[len(draft) - period])
    return draft
