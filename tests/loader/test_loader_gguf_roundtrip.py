"""A tiny llama GGUF written in the test (gguf.GGUFWriter, gguf.quants.quantize) loads back exactly."""

from __future__ import annotations

import math

import pytest
import torch

from ember.errors import ModelLoadError
from ember.loader import load_model


def test_every_quant_type_round_trips(gguf_writer) -> None:
    tiny = gguf_writer()
    loaded = load_model(tiny.path, dtype="float32")
    assert sorted(loaded.state_dict) == sorted(tiny.expected)
    for name, tensor in tiny.expected.items():
        assert loaded.state_dict[name].dtype == torch.float32
        assert torch.equal(loaded.state_dict[name], tensor), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_and_columns_read_alone_equal_slices_of_the_whole_tensor(gguf_writer, dtype) -> None:
    """What a tensor-parallel rank reads: q/k rows by whole heads (un-permuted per head), and columns that
    start and end inside quantization blocks (32 values) as well as on their edges, for every type."""
    loaded = load_model(gguf_writer(tied=False).path, dtype=dtype)
    weights, head_dim = loaded.state_dict, loaded.config.head_dim
    for name in weights:
        whole = weights[name]
        if whole.dim() == 1:
            assert torch.equal(weights.read(name, 0, 5, 20), whole[5:25]), name
            continue
        for start, length in ((0, 32), (32, 32), (7, 50), (40, 24)):
            assert torch.equal(weights.read(name, 1, start, length), whole[:, start : start + length]), name
        assert torch.equal(weights.read(name, 0, head_dim, head_dim), whole[head_dim : 2 * head_dim]), name


def test_config_from_metadata(gguf_writer) -> None:
    tiny = gguf_writer()
    config, d = load_model(tiny.path, dtype="float32").config, tiny.dims
    assert config.architecture == "LlamaForCausalLM"
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (
        d["hidden"], d["intermediate"], d["layers"])
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (d["heads"], d["kv_heads"], 16)
    assert config.vocab_size == len(tiny.vocab) and config.max_position_embeddings == 256
    assert config.rope_theta == 50000.0 and config.rms_norm_eps == pytest.approx(1e-6)
    assert config.tie_word_embeddings and not config.attention_bias and config.rope_scaling is None
    assert config.bos_token_id == 1 and config.eos_token_ids == [2]


def test_untied_output_and_bfloat16(gguf_writer) -> None:
    tiny = gguf_writer(tied=False)
    loaded = load_model(tiny.path, dtype="bfloat16")
    assert not loaded.config.tie_word_embeddings and "lm_head.weight" in loaded.state_dict
    for name, tensor in tiny.expected.items():
        assert torch.equal(loaded.state_dict[name], tensor.to(torch.bfloat16)), name


def test_qwen2_biases_are_not_permuted(gguf_writer) -> None:
    tiny = gguf_writer(arch="qwen2")
    loaded = load_model(tiny.path, dtype="float32")
    assert loaded.config.architecture == "Qwen2ForCausalLM" and loaded.config.attention_bias
    assert sorted(loaded.state_dict) == sorted(tiny.expected)
    for name, tensor in tiny.expected.items():
        assert torch.equal(loaded.state_dict[name], tensor), name


def test_tokenizer_and_chat_template_from_metadata(gguf_writer) -> None:
    from transformers import AutoTokenizer

    tiny = gguf_writer()
    tokenizer = load_model(tiny.path, dtype="float32").tokenizer
    hello, space_wo, rld = tiny.vocab.index("hello"), tiny.vocab.index("Ġwo"), tiny.vocab.index("rld")
    assert tokenizer.encode("hello world") == [1, hello, space_wo, rld]  # add_bos_token is set
    assert tokenizer.encode("hello world", add_special_tokens=False) == [hello, space_wo, rld]
    assert tokenizer.encode("<|im_end|>hello") == [1, 2, hello]
    assert tokenizer.decode([1, hello, space_wo, rld, 2]) == "hello world"
    assert tokenizer.decode([1, hello, 2], skip_special_tokens=False) == "<|im_start|>hello<|im_end|>"
    assert tokenizer.chat_template == tiny.chat_template
    messages = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hello"}]
    assert tokenizer.apply_chat_template(messages) == (
        "<|im_start|>system\nbe nice<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")

    reference = AutoTokenizer.from_pretrained(tiny.path.parent, gguf_file=tiny.path.name)
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == reference.apply_chat_template(
        messages, add_generation_prompt=False, tokenize=False)


@pytest.mark.parametrize(("pre", "pieces"), [("default", ["12", "!", "Ċ"]), ("smollm", ["12", "!", "Ċ"]),
                                             ("llama-bpe", ["12", "!Ċ"]), ("qwen2", ["1", "2", "!Ċ"])])
def test_byte_level_pre_tokenizers_match_transformers(gguf_writer, pre: str, pieces: list[str]) -> None:
    from transformers import AutoTokenizer

    tiny = gguf_writer(f"{pre}.gguf", tokenizer_pre=pre)
    tokenizer = load_model(tiny.path, dtype="float32").tokenizer
    assert tokenizer.encode("12!\n", add_special_tokens=False) == [tiny.vocab.index(p) for p in pieces]
    reference = AutoTokenizer.from_pretrained(tiny.path.parent, gguf_file=tiny.path.name)
    for text in ["hello world", "héllo wörld 😀\n\tcode()", "<|im_start|>user\nhello<|im_end|>",
                 "digits 1234567 and I'm   spaced\r\n\n", "HELLO's world!!"]:
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text), text
        assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True), text


def llama3_rope_factors(theta: float, head_dim: int, factor: float, low_freq_factor: float = 1.0,
                        high_freq_factor: float = 4.0, old_context_len: int = 8192) -> list[float]:
    """What llama.cpp's convert_hf_to_gguf.py writes to rope_freqs.weight for a llama3 rope_scaling."""
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_context_len / high_freq_factor:
            factors.append(1.0)
        elif wavelen > old_context_len / low_freq_factor:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors


def test_llama3_rope_frequency_factors_become_rope_scaling(gguf_writer) -> None:
    factors = llama3_rope_factors(500000.0, 16, factor=32.0)
    assert 1.0 in factors and 32.0 in factors and len(set(factors)) == 3  # all three bands present
    tiny = gguf_writer(rope_theta=500000.0, rope_freqs=factors)
    config = load_model(tiny.path, dtype="float32").config
    assert config.rope_scaling == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

    odd = gguf_writer("odd.gguf", rope_theta=500000.0,
                      rope_freqs=llama3_rope_factors(500000.0, 16, factor=8.0, high_freq_factor=2.0))
    with pytest.raises(ModelLoadError, match="rope_freqs.weight holds rope frequency factors that are not Llama 3"):
        load_model(odd.path)


def test_sentencepiece_tokenizer_matches_transformers(gguf_writer) -> None:
    from transformers import AutoTokenizer

    tiny = gguf_writer("spm.gguf", tokenizer_model="llama")
    tokenizer = load_model(tiny.path, dtype="float32").tokenizer
    assert tokenizer.encode("hello world") == [1, tiny.vocab.index("▁hello"), tiny.vocab.index("▁world")]
    # Characters outside the vocabulary fall back to their UTF-8 bytes.
    assert tokenizer.encode("hi€", add_special_tokens=False) == [
        tiny.vocab.index("▁h"), tiny.vocab.index("<0x69>"), *(tiny.vocab.index(f"<0x{b:02X}>") for b in "€".encode())]
    reference = AutoTokenizer.from_pretrained(tiny.path.parent, gguf_file=tiny.path.name)
    for text in ["hello world", " hello  world ", "héllo wörld 😀", "hello</s><s>world", "\n\thello\n", "é é"]:
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text), text
        assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True), text
        assert tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids), text
