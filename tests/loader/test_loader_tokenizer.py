"""Chat templates render with Hugging Face's conventions; load_tokenizer reads no weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import tokenizers

from ember.errors import ModelLoadError
from ember.loader import Tokenizer, load_tokenizer

MESSAGES = [{"role": "system", "content": "Sé breve. <b>&</b>"}, {"role": "user", "content": "¿Hola? 😀"}]


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir: Path) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def _with_template(hf_tokenizer: tokenizers.Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(hf_tokenizer, eos_token_ids=[2], bos_token_id=1, chat_template=template,
                     special_tokens={"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})


def _reference_render(template: str, **kwargs) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[MESSAGES], chat_template=template, **kwargs)
    return rendered[0]


@pytest.mark.parametrize("template", [
    # tojson keeps non-ASCII and HTML characters as they are, unlike Jinja's own filter
    "{{ bos_token }}{% for m in messages %}{{ m | tojson }}{{ eos_token }}{% endfor %}",
    "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{% for m in messages %}\n  {% generation %}{{ m.content }}{% endgeneration %}\n{% endfor %}",
    "{{ messages | length }} {{ tools | tojson }} {{ custom_flag | default('unset') }}",
])
def test_templates_render_like_transformers(hf_tokenizer: tokenizers.Tokenizer, template: str) -> None:
    tokenizer = _with_template(hf_tokenizer, template)
    for add_generation_prompt in (True, False):
        expected = _reference_render(template, add_generation_prompt=add_generation_prompt,
                                     bos_token="<|im_start|>", eos_token="<|im_end|>")
        assert tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt) == expected


def test_template_helpers_and_errors(hf_tokenizer: tokenizers.Tokenizer) -> None:
    tokenizer = _with_template(hf_tokenizer, "{% if messages[0].role != 'user' %}"
                                             "{{ raise_exception('first message must be from the user') }}"
                                             "{% endif %}{{ strftime_now('%Y') | length }}")
    with pytest.raises(ValueError, match="chat template error: first message must be from the user"):
        tokenizer.apply_chat_template(MESSAGES)
    assert tokenizer.apply_chat_template(MESSAGES[1:]) == "4"
    with pytest.raises(ValueError, match="chat template error"):
        _with_template(hf_tokenizer, "{{ messages[0].content + 1 }}").apply_chat_template(MESSAGES)
    with pytest.raises(ValueError, match="this model has no chat template"):
        _with_template(hf_tokenizer, None).apply_chat_template(MESSAGES)
    with pytest.raises(ModelLoadError, match="the chat template does not compile"):
        _with_template(hf_tokenizer, "{% for m in messages %}")
    # The sandbox refuses attribute access that could escape it.
    with pytest.raises(ValueError, match="chat template error"):
        _with_template(hf_tokenizer, "{{ messages.__class__.__mro__ }}").apply_chat_template(MESSAGES)


def test_load_tokenizer_without_weights(tiny_model_dir: Path, tmp_path: Path, gguf_writer) -> None:
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja"):
        (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    tokenizer = load_tokenizer(tmp_path)  # no weights in this folder
    assert tokenizer.eos_token_ids == [2] and tokenizer.bos_token_id == 1
    assert tokenizer.encode("hello world") == [28120, 905]
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")

    tiny = gguf_writer()
    assert load_tokenizer(tiny.path).encode("hello", add_special_tokens=False) == [tiny.vocab.index("hello")]


def test_continue_final_message(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer = load_tokenizer(tiny_model_dir)
    messages = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is "}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert rendered.endswith("<|im_start|>assistant\nThe color is ")
    assert rendered == reference.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    with pytest.raises(ValueError, match="cannot both be set"):
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)
