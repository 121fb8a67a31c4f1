"""Loading a Hugging Face folder: config, every tensor, tokenizer and chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ember.errors import ModelLoadError
from ember.loader import load_model

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


def test_config_fields(tiny_model_dir: Path) -> None:
    loaded = load_model(tiny_model_dir, dtype="float32")
    config = loaded.config
    assert (config.architecture, config.vocab_size, config.hidden_size, config.intermediate_size) == (
        "LlamaForCausalLM", 49152, 64, 128)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        2, 4, 2, 16)
    assert config.rms_norm_eps == 1e-5 and config.rope_theta == 10000.0 and config.rope_scaling is None
    assert config.max_position_embeddings == 1024 and config.tie_word_embeddings and not config.attention_bias
    assert config.bos_token_id == 1 and config.eos_token_ids == [2]
    assert config.torch_dtype == torch.float32
    assert loaded.source == str(tiny_model_dir.resolve())


def test_every_tensor_equals_the_safetensors_file(tiny_model_dir: Path) -> None:
    loaded = load_model(tiny_model_dir, dtype="float32")
    expected = load_file(tiny_model_dir / "model.safetensors")
    expected.pop("lm_head.weight", None)  # tied: the decoder uses the embedding
    assert sorted(loaded.state_dict) == sorted(expected)
    for name, tensor in expected.items():
        assert loaded.state_dict[name].dtype == torch.float32
        assert torch.equal(loaded.state_dict[name], tensor), name


def test_rows_and_columns_read_alone_equal_slices_of_the_whole_tensor(tiny_model_dir: Path) -> None:
    loaded = load_model(tiny_model_dir, dtype="bfloat16")
    expected = load_file(tiny_model_dir / "model.safetensors")
    for name in loaded.state_dict:
        whole = expected[name].to(torch.bfloat16)
        assert torch.equal(loaded.state_dict.read(name, 0, 3, 10), whole[3:13]), name
        if whole.dim() == 2:
            assert torch.equal(loaded.state_dict.read(name, 1, 16, 32), whole[:, 16:48]), name


def test_bfloat16_conversion(tiny_model_dir: Path) -> None:
    loaded = load_model(tiny_model_dir, dtype="bfloat16")
    assert loaded.config.torch_dtype == torch.bfloat16
    expected = load_file(tiny_model_dir / "model.safetensors")
    for name, tensor in loaded.state_dict.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, expected[name].to(torch.bfloat16)), name


def test_sharded_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    tensors = load_file(tiny_model_dir / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file_name, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, tmp_path / file_name, metadata={"format": "pt"})
    weight_map = {n: f for f, shard_names in shards.items() for n in shard_names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja"):
        (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    loaded = load_model(tmp_path, dtype="float32")
    for name, tensor in loaded.state_dict.items():
        assert torch.equal(tensor, tensors[name]), name

    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors listed in .* is missing"):
        load_model(tmp_path, dtype="float32")


def test_tokenizer_matches_transformers(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer = load_model(tiny_model_dir, dtype="float32").tokenizer
    assert tokenizer.vocab_size == len(reference)
    assert tokenizer.bos_token_id == reference.bos_token_id and tokenizer.eos_token_ids == [reference.eos_token_id]
    for text in ["Hello world", "  leading spaces\tand tabs\n\nnew lines", "def f(x):\n    return x ** 2  # 😀",
                 "<|im_start|>user\nhi<|im_end|>", "Grüße, 你好, こんにちは, привет, مرحبا 1234567"]:
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text)
        assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True)
        assert tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids)
    for add_generation_prompt in (True, False):
        assert tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=add_generation_prompt) == (
            reference.apply_chat_template(CONVERSATION, add_generation_prompt=add_generation_prompt, tokenize=False))
    assert tokenizer.apply_chat_template(CONVERSATION[1:2], tokenize=True) == reference.apply_chat_template(
        CONVERSATION[1:2], add_generation_prompt=True, tokenize=True, return_dict=False)


def _save_with_tokenizer(model, folder: Path, tiny_model_dir: Path) -> Path:
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).write_bytes((tiny_model_dir / name).read_bytes())
    return folder


SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=8192)


@pytest.mark.parametrize("family", ["qwen2", "mistral", "llama3"])
def test_other_families(family: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    import transformers

    if family == "qwen2":
        config = transformers.Qwen2Config(**SMALL, tie_word_embeddings=False, eos_token_id=[2, 0])
        model = transformers.Qwen2ForCausalLM(config)
    elif family == "mistral":
        config = transformers.MistralConfig(**SMALL, sliding_window=4096)
        model = transformers.MistralForCausalLM(config)
    else:
        rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
        config = transformers.LlamaConfig(**SMALL, rope_parameters=rope, attention_bias=True)
        model = transformers.LlamaForCausalLM(config)
    folder = _save_with_tokenizer(model, tmp_path / family, tiny_model_dir)
    loaded = load_model(folder, dtype="float32")
    reference = model.state_dict()
    if loaded.config.tie_word_embeddings:
        reference.pop("lm_head.weight")
    assert sorted(loaded.state_dict) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(loaded.state_dict[name], tensor), name

    config = loaded.config
    if family == "qwen2":
        assert config.architecture == "Qwen2ForCausalLM" and config.attention_bias
        assert "model.layers.0.self_attn.q_proj.bias" in loaded.state_dict
        assert "model.layers.0.self_attn.o_proj.bias" not in loaded.state_dict
        assert not config.tie_word_embeddings and config.eos_token_ids == [2, 0]
        assert config.max_position_embeddings == 8192  # use_sliding_window is off
    elif family == "mistral":
        # Full attention equals sliding-window attention while the context fits in the window.
        assert config.architecture == "MistralForCausalLM" and config.max_position_embeddings == 4096
    else:
        assert config.rope_theta == 500000.0 and config.attention_bias
        assert "model.layers.0.self_attn.o_proj.bias" in loaded.state_dict
        assert config.rope_scaling == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
