"""Load a llama.cpp GGUF file: dequantized weights under Hugging Face names, config and tokenizer from metadata."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from ember.errors import ModelLoadError
from ember.loader.gguf_reader import metadata_value, open_gguf
from ember.loader.gguf_tokenizer import build_gguf_tokenizer
from ember.loader.loaded_model import LoadedModel
from ember.loader.weights import check_state_dict
from ember.models.config import ModelConfig

# GGUF architecture -> Hugging Face architecture. Mistral and SmolLM2 files use "llama".
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_TENSOR_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSORS:
        return None
    layer, kind, param = match.groups()
    return f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.{param}"


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert convert_hf_to_gguf.py's `permute`, which interleaves the two rotary halves of every head
    (llama.cpp's rope pairs adjacent elements, Hugging Face's pairs element i with i + head_dim/2)."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape).contiguous())


def _hf_config(reader: GGUFReader, path: Path) -> dict[str, Any]:
    arch = metadata_value(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r} "
                             f"(supported: {', '.join(_ARCHITECTURES)})")

    def get(key: str, default: Any = None) -> Any:
        return metadata_value(reader, f"{arch}.{key}", default)

    required = {"hidden_size": "embedding_length", "num_hidden_layers": "block_count",
                "intermediate_size": "feed_forward_length", "num_attention_heads": "attention.head_count"}
    config: dict[str, Any] = {"architectures": [_ARCHITECTURES[arch]], "model_type": arch}
    for hf_key, gguf_key in required.items():
        value = get(gguf_key)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{gguf_key}")
        config[hf_key] = value
    num_heads = config["num_attention_heads"]
    head_dim = get("attention.key_length", config["hidden_size"] // num_heads)
    rotary_dim = get("rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise ModelLoadError(f"{path}: partial rotary embeddings ({rotary_dim} of {head_dim} dims) are not supported")
    rope_scaling = get("rope.scaling.type", "none")
    if rope_scaling not in ("none", None):
        raise ModelLoadError(f"{path}: rope scaling type {rope_scaling!r} is not supported")
    tokens = reader.get_field("tokenizer.ggml.tokens")
    config |= {
        "num_key_value_heads": get("attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "max_position_embeddings": get("context_length", 2048),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": get("rope.freq_base", 10000.0),
        "vocab_size": get("vocab_size", len(tokens.data) if tokens is not None else None),
        # llama.cpp writes no output tensor when the model ties it to the embedding.
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "bos_token_id": metadata_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": [metadata_value(reader, f"tokenizer.ggml.{key}_token_id")
                         for key in ("eos", "eot", "eom")
                         if metadata_value(reader, f"tokenizer.ggml.{key}_token_id") is not None],
    }
    if config["vocab_size"] is None:
        raise ModelLoadError(f"{path}: GGUF metadata has neither {arch}.vocab_size nor a tokenizer vocabulary")
    if arch == "qwen2":
        config["sliding_window"] = get("attention.sliding_window")
    return config


def _to_torch(tensor: Any, dtype: torch.dtype) -> torch.Tensor:
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    qtype = GGMLQuantizationType(tensor.tensor_type)
    if qtype == GGMLQuantizationType.BF16:  # exact, no float32 round trip
        return torch.from_numpy(np.array(tensor.data).view(np.int16)).view(torch.bfloat16).reshape(shape).to(dtype)
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        # Copy out of the read-only memory map so the tensors outlive the file.
        return torch.from_numpy(np.array(tensor.data)).reshape(shape).to(dtype)
    try:
        values = dequantize(tensor.data, qtype)
    except NotImplementedError:
        raise ModelLoadError(f"tensor {tensor.name} uses quantization type {qtype.name}, which Ember "
                             f"cannot dequantize") from None
    return torch.from_numpy(values).reshape(shape).to(dtype)


def load_gguf(path: Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu") -> LoadedModel:
    reader = open_gguf(path)
    config = ModelConfig.from_hf_config(_hf_config(reader, path), dtype=dtype, device=device)
    # Only the llama architecture's converter permutes q/k rows (qwen2 uses NeoX-style rope natively).
    permuted = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads} \
        if metadata_value(reader, "general.architecture") == "llama" else {}
    state_dict: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            raise ModelLoadError(f"{path}: unexpected tensor {tensor.name} for {config.architecture}")
        try:
            weight = _to_torch(tensor, config.torch_dtype)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{path}: {exc}") from None
        except ValueError as exc:
            raise ModelLoadError(f"{path}: tensor {tensor.name} is corrupt ({exc})") from None
        projection = name.split(".")[-2]
        if projection in permuted:
            weight = unpermute_rows(weight, permuted[projection])
        state_dict[name] = weight
    state_dict = check_state_dict(config, state_dict, str(path))
    tokenizer = build_gguf_tokenizer(reader, path, eos_token_ids=config.eos_token_ids,
                                     bos_token_id=config.bos_token_id)
    return LoadedModel(config=config, state_dict=state_dict, tokenizer=tokenizer, source=str(path))
