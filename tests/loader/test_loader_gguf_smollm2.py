"""The real SmolLM2 GGUF: weights, config and tokenizer must equal what transformers builds from the same file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ember.loader import LoadedModel, resolve_model

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello world",
    "Hello, world! How are you doing today?",
    "  two leading spaces, trailing spaces   ",
    "tabs\tand\nnew\n\nlines\r\n",
    "Grüße aus München – naïve café, déjà vu",
    "你好，世界！今天天气很好。",
    "こんにちは世界、カタカナとひらがな",
    "Привет, мир! Как дела?",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "emoji 😀🎉👍🏽 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # recursion\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }",
    "<html><body class=\"x\">&amp; &lt;tag&gt;</body></html>",
    "numbers 0 12 345 6789 3.14159 1e-10 1,000,000 2024-12-02",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>special<repo_name>tokens<file_sep>inline",
    "Math: ∑_{i=1}^{n} i² = n(n+1)/2, ∀x∈ℝ, √2 ≈ 1.414",
    "",
    " ",
    "\u200b zero width and \u00a0 nbsp and combining e\u0301",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Say hi 👋"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And times 3?"}],
]


@pytest.fixture(scope="module")
def hf_reference(smollm2_gguf_path: Path):
    """(config, state_dict) as transformers' from_pretrained(gguf_file=...) builds them; its own GGUF code path
    is called directly because from_pretrained additionally insists on the accelerate package."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name)
    with torch.device("meta"):  # only used to map tensor names: skip allocating and initializing weights
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(smollm2_gguf_path, return_tensors=True, model_to_load=model,
                                   torch_dtype=torch.float32)["tensors"]
    return config, tensors


def test_alias_resolves_to_the_packaged_gguf(smollm2_gguf_path: Path) -> None:
    assert resolve_model("smollm2-135m-instruct") == smollm2_gguf_path
    assert resolve_model("SmolLM2-135M-Instruct") == smollm2_gguf_path
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == smollm2_gguf_path


def test_config_matches_transformers(smollm2_loaded: LoadedModel, hf_reference) -> None:
    config, reference = smollm2_loaded.config, hf_reference[0]
    assert config.architecture == "LlamaForCausalLM"
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                  "bos_token_id"):
        assert getattr(config, field) == getattr(reference, field), field
    assert config.rms_norm_eps == pytest.approx(reference.rms_norm_eps, rel=1e-6)
    assert config.rope_theta == reference.rope_parameters["rope_theta"] == 100000.0
    assert config.rope_scaling is None and not config.attention_bias
    assert config.eos_token_ids == [reference.eos_token_id] == [2]
    assert config.torch_dtype == torch.float32


def test_every_tensor_matches_transformers(smollm2_loaded: LoadedModel, hf_reference) -> None:
    reference = hf_reference[1]
    assert sorted(smollm2_loaded.state_dict) == sorted(reference)
    for name, tensor in reference.items():
        ours = smollm2_loaded.state_dict[name]
        assert ours.dtype == torch.float32 and ours.shape == tensor.shape, name
        assert torch.equal(ours, tensor), name  # same dequantization, q/k un-permuted exactly


def test_tokenizer_matches_transformers(smollm2_loaded: LoadedModel, smollm2_hf_tokenizer) -> None:
    tokenizer, reference = smollm2_loaded.tokenizer, smollm2_hf_tokenizer
    assert tokenizer.vocab_size == len(reference) == 49152
    assert (tokenizer.bos_token, tokenizer.eos_token) == (reference.bos_token, reference.eos_token)
    assert tokenizer.bos_token_id == reference.bos_token_id and tokenizer.eos_token_ids == [reference.eos_token_id]
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text), text
        assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True), text
        assert tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids), text
        assert tokenizer.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids), text
    assert tokenizer.decode(list(range(0, 49152, 97))) == reference.decode(list(range(0, 49152, 97)),
                                                                          skip_special_tokens=True)


def test_chat_template_matches_transformers(smollm2_loaded: LoadedModel, smollm2_hf_tokenizer) -> None:
    tokenizer, reference = smollm2_loaded.tokenizer, smollm2_hf_tokenizer
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            expected = reference.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                     tokenize=False)
            assert tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
            assert tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 tokenize=True) == reference.encode(expected, add_special_tokens=False)
