"""A thin wrapper over a `tokenizers.Tokenizer` plus the model's chat template, with Hugging Face semantics."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import jinja2
import tokenizers
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ember.errors import ModelLoadError


class _GenerationTagExtension(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in HF templates;
    rendering just emits the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which would change what the model sees.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTagExtension, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """Encode/decode and chat-template rendering for one model.

    `special_tokens` maps HF's names (bos_token, eos_token, unk_token, pad_token) to token strings; they are
    visible to the chat template as variables, as in transformers."""

    def __init__(self, hf_tokenizer: tokenizers.Tokenizer, *, eos_token_ids: Sequence[int],
                 bos_token_id: int | None = None, special_tokens: dict[str, str | None] | None = None,
                 chat_template: str | None = None) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.chat_template = chat_template
        try:
            self._compiled_template = compile_chat_template(chat_template) if chat_template else None
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ModelLoadError(f"the chat template does not compile: {exc} (line {exc.lineno})") from None
        self.vocab_size = hf_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.hf_tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self.hf_tokenizer.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self.hf_tokenizer.token_to_id(token)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, tools: list[dict[str, Any]] | None = None,
                            continue_final_message: bool = False, chat_template: jinja2.Template | None = None,
                            **template_kwargs: Any) -> str | list[int]:
        """Render `messages` with the model's chat template (as transformers does), or with `chat_template`
        (compiled by compile_chat_template) in its place.

        `continue_final_message` leaves the last message open, so the model continues it (a prefill).
        Raises ValueError when the model has no template or the template rejects the conversation."""
        template = chat_template or self._compiled_template
        if template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
        context = {**self.special_tokens, **template_kwargs}
        try:
            text = template.render(messages=list(messages), tools=tools,
                                                  add_generation_prompt=add_generation_prompt, **context)
        except (jinja2.exceptions.TemplateError, TypeError) as exc:
            raise ValueError(f"chat template error: {exc}") from None
        if continue_final_message:
            text = _cut_after_final_message(text, messages)
        if tokenize:
            # The template writes the special tokens itself.
            return self.encode(text, add_special_tokens=False)
        return text


def _cut_after_final_message(text: str, messages: Sequence[dict[str, Any]]) -> str:
    """Drop what the template writes after the last message's content (its end-of-turn marker)."""
    final = messages[-1].get("content") if messages else None
    if isinstance(final, list):  # content parts: continue the last text part
        final = next((part.get("text") for part in reversed(final) if isinstance(part, dict) and "text" in part), None)
    if not isinstance(final, str):
        raise ValueError("continue_final_message needs a final message with text content")
    for candidate in (final, final.strip()):
        if candidate and candidate in text:
            return text[: text.rindex(candidate) + len(candidate)]
    raise ValueError("continue_final_message is set but the final message does not appear in the rendered chat")
