"""What the router may know about a request when it picks a replica (built once per request by
ember.gateway.dispatch; policies read only the fields they need)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property


@dataclass(eq=False)
class RequestContext:
    model: str  # the name the client used (a key under `models:` in the config)
    endpoint: str  # "chat/completions" | "completions"
    body: dict  # the parsed request body, read-only
    key_id: str
    priority: int
    client_region: str | None = None  # from x-ember-region, else the listener's region
    session_id: str | None = None  # from x-ember-session-id, else the body's `user` field
    is_background: bool = False
    attempt: int = 0  # 0 for the first try, then one more per failover retry
    extra: dict = field(default_factory=dict)

    @cached_property
    def prompt_text(self) -> str:
        """The prompt as one string (chat messages' text contents concatenated in order), for
        prefix-aware routing. Computed on first use only."""
        if self.endpoint == "completions":
            prompt = self.body.get("prompt")
            if isinstance(prompt, str):
                return prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                return prompt[0]
            return ""
        parts: list[str] = []
        messages = self.body.get("messages")
        for message in messages if isinstance(messages, list) else ():  # the replica answers the 400
            if not isinstance(message, dict):
                continue
            parts.append(str(message.get("role", "")))
            content = message.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(str(item.get("text", "")) for item in content if isinstance(item, dict))
        return "\n".join(parts)
