"""Loader fixtures: the real SmolLM2 GGUF loaded once per session, by Ember and by transformers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from ember.loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def smollm2_loaded(smollm2_gguf_path: Path) -> LoadedModel:
    return load_model(smollm2_gguf_path, dtype="float32")


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_gguf_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name)


# A tiny byte-level BPE vocabulary: three control tokens, the 256 byte symbols, and a few merges.
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# "! Ċ" (Ċ spells a newline) and "1 2" merge only where the pre-tokenizer's split regex keeps them together.
_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o", "r l", "rl d", "! Ċ", "1 2"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_symbols() -> list[str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def tiny_vocab() -> list[str]:
    return _SPECIALS + _byte_symbols() + [merge.replace(" ", "") for merge in _MERGES]


# A tiny SentencePiece vocabulary (Llama 2 style): <unk>, <s>, </s>, 256 byte tokens, scored pieces.
_SPM_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "é", "▁h", "he", "ll", "lo", "▁he", "llo", "▁hel",
               "▁hello", "▁w", "or", "▁wor", "ld", "▁world", "▁é"]


def tiny_spm_vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + _SPM_PIECES
    scores = [0.0] * 259 + [-float(i) for i in range(len(_SPM_PIECES))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(_SPM_PIECES)  # unknown, control, byte, normal
    return tokens, scores, types


def _permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's q/k row permutation (HF rotary halves -> interleaved pairs)."""
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2) \
        .reshape(weights.shape)


TINY_GGUF_DIMS = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2)
_CYCLE = [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
          GGMLQuantizationType.F16, GGMLQuantizationType.BF16, GGMLQuantizationType.F32]


# K-quant type -> bytes per super-block of 256, the offset of its fp16 scales (d, and dmin for Q4_K), their count
_K_QUANTS = {GGMLQuantizationType.Q4_K: (144, 0, 2), GGMLQuantizationType.Q5_K: (176, 0, 2),
             GGMLQuantizationType.Q6_K: (210, 208, 1)}


@dataclass
class TinyGGUF:
    path: Path
    expected: dict[str, torch.Tensor]  # HF name -> what the loader must produce (float32)
    vocab: list[str]
    chat_template: str = CHAT_TEMPLATE
    dims: dict[str, int] = field(default_factory=lambda: dict(TINY_GGUF_DIMS))


def write_tiny_gguf(path: Path, *, arch: str = "llama", qtype_overrides: dict[str, GGMLQuantizationType] | None = None,
                    drop: tuple[str, ...] = (), tied: bool = True, tokenizer_model: str = "gpt2", tokenizer_pre: str = "default",
                    intermediate_in_metadata: int | None = None, rope_theta: float = 50000.0,
                    rope_freqs: list[float] | None = None, dims: dict[str, int] | None = None) -> TinyGGUF:
    """Write a random llama GGUF (TINY_GGUF_DIMS, or `dims`) with a tokenizer section; return the HF-named
    tensors a loader must produce (each one quantized and dequantized with gguf.quants, in Hugging Face row
    order)."""
    d = TINY_GGUF_DIMS | (dims or {})
    hidden, inter, heads, kv_heads = d["hidden"], d["intermediate"], d["heads"], d["kv_heads"]
    head_dim = hidden // heads
    vocab = tiny_spm_vocab()[0] if tokenizer_model == "llama" else tiny_vocab()
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": ("model.embed_tokens.weight", (len(vocab), hidden)),
              "output_norm.weight": ("model.norm.weight", (hidden,))}
    if not tied:
        shapes["output.weight"] = ("lm_head.weight", (len(vocab), hidden))
    for i in range(d["layers"]):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (f"model.layers.{i}.input_layernorm.weight", (hidden,)),
            f"blk.{i}.ffn_norm.weight": (f"model.layers.{i}.post_attention_layernorm.weight", (hidden,)),
            f"blk.{i}.attn_q.weight": (f"model.layers.{i}.self_attn.q_proj.weight", (heads * head_dim, hidden)),
            f"blk.{i}.attn_k.weight": (f"model.layers.{i}.self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
            f"blk.{i}.attn_v.weight": (f"model.layers.{i}.self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
            f"blk.{i}.attn_output.weight": (f"model.layers.{i}.self_attn.o_proj.weight", (hidden, heads * head_dim)),
            f"blk.{i}.ffn_gate.weight": (f"model.layers.{i}.mlp.gate_proj.weight", (inter, hidden)),
            f"blk.{i}.ffn_up.weight": (f"model.layers.{i}.mlp.up_proj.weight", (inter, hidden)),
            f"blk.{i}.ffn_down.weight": (f"model.layers.{i}.mlp.down_proj.weight", (hidden, inter)),
        }
        if arch == "qwen2":
            shapes |= {f"blk.{i}.attn_{p}.bias": (f"model.layers.{i}.self_attn.{p}_proj.bias", (n * head_dim,))
                       for p, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))}

    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(d["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate_in_metadata or inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(vocab))
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_token_list(vocab)
    if tokenizer_model == "llama":
        _, scores, types = tiny_spm_vocab()
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_unk_token_id(0)
    else:
        writer.add_tokenizer_pre(tokenizer_pre)
        writer.add_token_types([3] * len(_SPECIALS) + [1] * (len(vocab) - len(_SPECIALS)))
        writer.add_token_merges(_MERGES)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(True)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)

    expected: dict[str, torch.Tensor] = {}
    for index, (gguf_name, (name, shape)) in enumerate(shapes.items()):
        values = rng.standard_normal(shape, dtype=np.float32)
        qtype = (qtype_overrides or {}).get(gguf_name, _CYCLE[index % len(_CYCLE)] if len(shape) == 2
                                            else GGMLQuantizationType.F32)
        stored = values
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            stored = _permute(values, heads if "attn_q" in gguf_name else kv_heads)
        if gguf_name in drop:
            continue
        if qtype in _K_QUANTS:  # gguf cannot quantize to them: random super-blocks, small fp16 scales
            block_bytes, at, count = _K_QUANTS[qtype]
            blocks = rng.integers(0, 256, (shape[0], shape[1] // 256, block_bytes), dtype=np.uint8)
            floats = (rng.random((shape[0], shape[1] // 256, count)) * 0.02).astype(np.float16)
            blocks[:, :, at : at + 2 * count] = floats.view(np.uint8).reshape(shape[0], -1, 2 * count)
            raw = blocks.reshape(shape[0], -1)
            if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
                raw = _permute(raw, heads if "attn_q" in gguf_name else kv_heads)  # rows of blocks move whole
            writer.add_tensor(gguf_name, raw, raw_dtype=qtype)
            expected[name] = torch.from_numpy(gguf.quants.dequantize(blocks.reshape(shape[0], -1), qtype)
                                              .reshape(shape).copy())
            continue
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            writer.add_tensor(gguf_name, gguf.quants.quantize(stored, qtype))
        elif qtype == GGMLQuantizationType.Q8_1:  # gguf cannot produce it; any bytes of the right size do
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.zeros((shape[0], shape[-1] // block * type_size), dtype=np.uint8)
            writer.add_tensor(gguf_name, raw, raw_dtype=qtype)
            continue
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
        # Quantization works on blocks within a row, so it commutes with the row permutation.
        expected[name] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(values, qtype), qtype)
                                          .reshape(shape).copy())
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.array(rope_freqs, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGGUF(path, expected, vocab, dims=d)


@pytest.fixture
def gguf_writer(tmp_path: Path) -> Callable[..., TinyGGUF]:
    """write_tiny_gguf(name="tiny.gguf", **options) into the test's tmp_path."""

    def write(name: str = "tiny.gguf", **options: Any) -> TinyGGUF:
        return write_tiny_gguf(tmp_path / name, **options)

    return write

