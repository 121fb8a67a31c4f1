"""Admission's token estimate for one request, before any replica has seen it.

Quotas reserve this estimate when a request is admitted and settle it from the replica's `usage`
when it completes, so the estimate covers everything the request can cost: every prompt of a
/v1/completions list (text or token ids) and every chat message, plus `max_tokens` for each
choice (`n`, or `best_of` when larger) of each prompt. The gateway has no tokenizer (it never loads
a model), so text is counted at OpenAI's rule of thumb of four characters per token; token-id
prompts are counted exactly. The body is read defensively: a malformed field counts as absent
(the replica answers it with a 400 of its own).
"""

from __future__ import annotations

import math
from typing import Any

CHARS_PER_TOKEN = 4
# Role markers and separators a chat template wraps each message in.
MESSAGE_OVERHEAD_TOKENS = 4


def estimate_request_tokens(endpoint: str, body: dict[str, Any], default_max_tokens: int) -> int:
    """Prompt tokens of every prompt plus `max_tokens` for every choice of every prompt.
    `default_max_tokens` stands in when the body sets no valid max_tokens."""
    prompts = _completion_prompt_tokens(body.get("prompt")) if endpoint == "completions" else [_chat_tokens(body)]
    max_tokens = _positive_int(body.get("max_completion_tokens")) or _positive_int(body.get("max_tokens"))
    choices = max(_positive_int(body.get("n")) or 1, _positive_int(body.get("best_of")) or 1)
    return sum(prompts) + len(prompts) * choices * (max_tokens or default_max_tokens)


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


def _text_tokens(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def _completion_prompt_tokens(prompt: Any) -> list[int]:
    """One count per prompt: a string, a list of token ids, or a list of either."""
    if isinstance(prompt, str):
        return [_text_tokens(prompt)]
    if not isinstance(prompt, list) or not prompt:
        return [0]
    if all(isinstance(item, int) for item in prompt):
        return [len(prompt)]
    return [_text_tokens(item) if isinstance(item, str) else len(item) if isinstance(item, list) else 0 for item in prompt]


def _chat_tokens(body: dict[str, Any]) -> int:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return 0
    total = 0
    for message in messages:
        if not isinstance(message, dict):
            continue
        total += MESSAGE_OVERHEAD_TOKENS
        content = message.get("content")
        if isinstance(content, str):
            total += _text_tokens(content)
        elif isinstance(content, list):
            total += sum(
                _text_tokens(part["text"]) for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
            )
    return total
