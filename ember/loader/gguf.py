"""Load a llama.cpp GGUF file: weights under Hugging Face names, config and tokenizer from metadata.

Weights are read when the model asks for them, whole or by rows or columns (dequantized to the model dtype), so
a tensor-parallel rank reads only its slice. With quantization="gguf" the Linear layers' weights of the block
types Ember's kernels run (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) stay in their blocks (QuantizedWeight,
taken whole), and a tied output layer gets its own quantized lm_head.weight from the embedding's blocks (the
embedding itself, a lookup table, is dequantized)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from ember.errors import ModelLoadError
from ember.kernels.quantized_weight import GGUF_BLOCK_FORMATS, QuantizedWeight
from ember.loader.gguf_reader import metadata_value, open_gguf
from ember.loader.gguf_tokenizer import build_gguf_tokenizer, special_token_ids
from ember.loader.lazy_weights import LazyStateDict, QuantizedSource, TensorSource
from ember.loader.loaded_model import LoadedModel
from ember.loader.tokenizer import Tokenizer
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
_ROPE_FREQS = "rope_freqs.weight"
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
    bos_token_id, eos_token_ids = special_token_ids(reader)
    config |= {
        "num_key_value_heads": get("attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "max_position_embeddings": get("context_length", 2048),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": get("rope.freq_base", 10000.0),
        "vocab_size": get("vocab_size", len(tokens.data) if tokens is not None else None),
        # llama.cpp writes no output tensor when the model ties it to the embedding.
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_ids,
    }
    if config["vocab_size"] is None:
        raise ModelLoadError(f"{path}: GGUF metadata has neither {arch}.vocab_size nor a tokenizer vocabulary")
    return config


class GGUFTensor:
    """A GGUF tensor (quantized or not). Quantized blocks run along a row, so a range of rows is one range
    of bytes; a range of columns is a range of blocks in every row, widened to whole blocks, dequantized,
    then cut to the columns asked for."""

    def __init__(self, tensor: Any, path: Path, permuted_heads: int | None = None) -> None:
        self.tensor, self.path = tensor, path
        self.qtype = GGMLQuantizationType(tensor.tensor_type)
        self.shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
        # llama.cpp's converter interleaves the rotary halves of every q/k head: undone per head on read.
        self.permuted_heads = permuted_heads
        self._decode(tensor.data[:1])  # an unsupported quantization type fails the load, not the first read

    def read(self, dim: int, start: int, length: int) -> torch.Tensor:
        data = self.tensor.data
        if dim == 0:
            values = self._decode(data[start : start + length]).reshape(length, *self.shape[1:])
        elif data.dtype == np.uint8:  # quantized (or bfloat16) bytes: whole blocks, then the columns
            block, type_size = GGML_QUANT_SIZES[self.qtype]
            first_block, end_block = start // block, -(-(start + length) // block)
            offset = start - first_block * block
            values = self._decode(data[:, first_block * type_size : end_block * type_size])
            values = values.reshape(self.shape[0], -1)[:, offset : offset + length].contiguous()
        else:
            values = self._decode(data[:, start : start + length])
        if self.permuted_heads is not None:
            values = self._unpermute(values, dim, start, length)
        return values

    def _decode(self, raw: np.ndarray) -> torch.Tensor:
        try:
            if self.qtype == GGMLQuantizationType.BF16:  # exact, no float32 round trip
                return torch.from_numpy(np.array(raw).view(np.int16)).view(torch.bfloat16)
            if self.qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                return torch.from_numpy(np.array(raw))  # copied out of the read-only map
            return torch.from_numpy(dequantize(np.ascontiguousarray(raw), self.qtype))
        except NotImplementedError:
            raise ModelLoadError(f"{self.path}: tensor {self.tensor.name} uses quantization type "
                                 f"{self.qtype.name}, which Ember cannot dequantize") from None
        except (ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"{self.path}: tensor {self.tensor.name} is corrupt ({exc})") from None

    def _unpermute(self, values: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
        rows_per_head = self.shape[0] // self.permuted_heads
        if dim == 0 and (start % rows_per_head or length % rows_per_head):
            raise ValueError(f"{self.tensor.name}: rows {start}..{start + length} are not whole heads")
        return unpermute_rows(values, length // rows_per_head if dim == 0 else self.permuted_heads)


def _llama3_rope_scaling(factors: np.ndarray, rope_theta: float, head_dim: int, path: Path) -> dict[str, Any]:
    """llama.cpp stores Llama 3.1+'s rope scaling as per-frequency factors (rope_freqs.weight) instead of
    parameters. Every Llama 3.x uses the same band edges, so recognise those and return HF's parameters."""
    params = {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    wavelengths = 2 * np.pi * rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    old_context = params["original_max_position_embeddings"]
    smooth = (old_context / wavelengths - params["low_freq_factor"]) / (
        params["high_freq_factor"] - params["low_freq_factor"])
    expected = np.where(wavelengths < old_context / params["high_freq_factor"], 1.0,
                        np.where(wavelengths > old_context / params["low_freq_factor"], params["factor"],
                                 1 / ((1 - smooth) / params["factor"] + smooth)))
    if factors.shape != expected.shape or not np.allclose(factors, expected, rtol=1e-5):
        raise ModelLoadError(f"{path}: rope_freqs.weight holds rope frequency factors that are not Llama 3's "
                             f"scaling, which is the only one supported")
    return params


def _tensor_sources(reader: GGUFReader, path: Path, config: ModelConfig, quantized: bool) -> LazyStateDict:
    # Only the llama architecture's converter permutes q/k rows (qwen2 uses NeoX-style rope natively).
    permuted = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads} \
        if config.architecture == "LlamaForCausalLM" else {}
    sources: dict[str, TensorSource] = {}
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:
            continue
        name = hf_name(tensor.name)
        if name is None:
            raise ModelLoadError(f"{path}: unexpected tensor {tensor.name} for {config.architecture}")
        heads = permuted.get(name.split(".")[-2])
        block_type = GGMLQuantizationType(tensor.tensor_type).name
        kept_in_blocks = quantized and block_type in GGUF_BLOCK_FORMATS
        if kept_in_blocks and (name.endswith("_proj.weight") or name == "lm_head.weight"):
            sources[name] = QuantizedSource(_blocks(tensor, block_type, heads))
        else:
            sources[name] = GGUFTensor(tensor, path, heads)
        if kept_in_blocks and name == "model.embed_tokens.weight" and config.tie_word_embeddings:
            sources["lm_head.weight"] = QuantizedSource(_blocks(tensor, block_type, None))
    return LazyStateDict(check_state_dict(config, sources, str(path)), config.torch_dtype)


def _blocks(tensor: Any, block_type: str, permuted_heads: int | None) -> QuantizedWeight:
    """A GGUF tensor's blocks of a type of GGUF_BLOCK_FORMATS, with llama.cpp's q/k row interleave undone."""
    weight = QuantizedWeight.from_gguf_blocks(block_type, tensor.data, int(tensor.shape[1]))
    if permuted_heads is None:
        return weight
    return weight.map_rows(lambda rows: unpermute_rows(rows, permuted_heads))


def load_gguf(path: Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
              quantization: str = "none") -> LoadedModel:
    """quantization "gguf" (and "auto") keeps the Linear layers' blocks of the types Ember's kernels run (see the
    module docstring)."""
    reader = open_gguf(path)
    splits = metadata_value(reader, "split.count", 1)
    if splits > 1:
        raise ModelLoadError(f"{path} is part {metadata_value(reader, 'split.no', 0) + 1} of a GGUF split into "
                             f"{splits} files, which Ember does not load: merge them first with "
                             f"`llama-gguf-split --merge`")
    try:
        config = ModelConfig.from_hf_config(_hf_config(reader, path), dtype=dtype, device=device)
        # The tokenizer first: it is the cheap part and the likelier to be unsupported.
        tokenizer = build_gguf_tokenizer(reader, path)
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{path}: corrupt GGUF metadata ({exc})") from None
    rope_freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if rope_freqs is not None:
        source = GGUFTensor(rope_freqs, path)
        factors = source.read(0, 0, source.shape[0]).double().numpy()
        config = replace(config, rope_scaling=_llama3_rope_scaling(factors, config.rope_theta, config.head_dim, path))
    state_dict = _tensor_sources(reader, path, config, quantization in ("gguf", "auto"))
    return LoadedModel(config=config, state_dict=state_dict, tokenizer=tokenizer, source=str(path))


def load_gguf_tokenizer(path: Path) -> Tokenizer:
    reader = open_gguf(path)
    try:
        return build_gguf_tokenizer(reader, path)
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{path}: corrupt GGUF metadata ({exc})") from None
