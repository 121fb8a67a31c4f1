"""Logprobs in the API's three shapes, built from the engine's Logprob entries: chat's `content` list,
completions' legacy parallel lists, and vLLM's `prompt_logprobs`. Token text is the engine's
(Logprob.decoded_token)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ember.engine.outputs import Logprob
from ember.server.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)

if TYPE_CHECKING:
    from ember.loader.tokenizer import Tokenizer

# JSON has no -inf; vLLM reports this floor for tokens the model rules out.
MIN_LOGPROB = -9999.0


class LogprobFormatter:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    def token_text(self, token_id: int, logprob: Logprob | None) -> str:
        """The token's text as the engine decoded it for its logprob entry. Only an echoed prompt's first
        token has no entry (nothing precedes it to score it); its text is decoded here, as echo's is."""
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _top(self, entries: dict[int, Logprob], k: int) -> list[tuple[str, float]]:
        ranked = sorted(entries.items(), key=lambda item: item[1].rank)[:k]
        return [(self.token_text(tid, lp), max(lp.logprob, MIN_LOGPROB)) for tid, lp in ranked]

    def chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]], k: int) -> ChatLogprobs:
        content = []
        for token_id, entries in zip(token_ids, logprobs, strict=False):
            sampled = entries.get(token_id)
            text = self.token_text(token_id, sampled)
            content.append(
                ChatTokenLogprob(
                    token=text,
                    logprob=MIN_LOGPROB if sampled is None else max(sampled.logprob, MIN_LOGPROB),
                    bytes=list(text.encode("utf-8")),
                    top_logprobs=[
                        TopLogprob(token=t, logprob=lp, bytes=list(t.encode("utf-8")))
                        for t, lp in self._top(entries, k)
                    ],
                )
            )
        return ChatLogprobs(content=content)

    def prompt_logprobs(self, entries: list[dict[int, Logprob] | None] | None) -> PromptLogprobs | None:
        """vLLM's prompt_logprobs field: per prompt token (None for the first), token id -> logprob, rank and
        text, -inf floored as everywhere in the API."""
        if entries is None:
            return None
        return [
            None if entry is None else {
                token_id: PromptLogprob(logprob=max(lp.logprob, MIN_LOGPROB), rank=lp.rank,
                                        decoded_token=self.token_text(token_id, lp))
                for token_id, lp in entry.items()
            }
            for entry in entries
        ]  # fmt: skip

    def completion_logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, Logprob] | None], k: int, text_offset: int
    ) -> CompletionLogprobs:
        """Completions' logprobs; an entry of None (the first prompt token with echo) has no logprob."""
        result = CompletionLogprobs()
        for token_id, entries in zip(token_ids, logprobs, strict=False):
            sampled = entries.get(token_id) if entries else None
            text = self.token_text(token_id, sampled)
            result.tokens.append(text)
            result.text_offset.append(text_offset)
            text_offset += len(text)
            if entries is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(
                MIN_LOGPROB if sampled is None else max(sampled.logprob, MIN_LOGPROB)
            )
            top = dict(self._top(entries, k))
            if sampled is not None:  # as vLLM (and OpenAI's legacy API): the chosen token is always listed
                top.setdefault(text, max(sampled.logprob, MIN_LOGPROB))
            result.top_logprobs.append(top)
        return result
