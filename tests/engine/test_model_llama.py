"""The decoder against Hugging Face transformers on the same weights: logits through the paged KV cache,
as one prefill, in chunks, and in a batch mixing decodes with prefill chunks; Qwen2 biases; llama3 RoPE."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ember.layers import attention
from ember.layers.attention import SequenceSpan, build_attention_metadata
from ember.models import ModelConfig, build_model

BLOCK_SIZE = 4
NUM_BLOCKS = 64
ATOL = 1e-4


class PagedModel:
    """Our model plus a KV cache; feeds (sequence, chunk) batches the way the engine does."""

    def __init__(self, model_dir: Path) -> None:
        config = ModelConfig.from_hf_config(json.loads((model_dir / "config.json").read_text()), dtype="float32")
        self.config = config
        self.model = build_model(config)
        self.model.load_weights(load_file(model_dir / "model.safetensors"))
        self.kv_caches = [
            torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 2, config.num_key_value_heads, config.head_dim)
            for _ in range(config.num_hidden_layers)
        ]

    def step(self, batch: list[tuple[list[int], int, int, list[int]]]) -> list[torch.Tensor]:
        """batch: (token_ids, num_computed, num_new, block_table) per sequence -> logits [num_new, V] each."""
        input_ids, positions, spans = [], [], []
        for token_ids, computed, new, table in batch:
            input_ids += token_ids[computed : computed + new]
            positions += range(computed, computed + new)
            spans.append(SequenceSpan(computed, new, table))
        meta = build_attention_metadata(spans, BLOCK_SIZE, torch.float32, torch.device("cpu"))
        self.last_metadata = meta
        with torch.inference_mode():
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), meta, self.kv_caches)
            logits = self.model.compute_logits(hidden)
        return list(logits.split([new for _, _, new, _ in batch]))


def reference_logits(hf_model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def prompt(seed: int, length: int, vocab: int = 49152) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def hf_llama(tiny_model_dir: Path) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture
def paged(tiny_model_dir: Path) -> PagedModel:
    return PagedModel(tiny_model_dir)


def test_full_prompt_as_one_prefill(paged: PagedModel, hf_llama: torch.nn.Module) -> None:
    tokens = prompt(0, 23)
    (logits,) = paged.step([(tokens, 0, len(tokens), [9, 2, 31, 5, 17, 40])])
    torch.testing.assert_close(logits, reference_logits(hf_llama, tokens), atol=ATOL, rtol=0)


def test_prompt_in_chunks_of_five_through_a_non_contiguous_block_table(
    paged: PagedModel, hf_llama: torch.nn.Module
) -> None:
    tokens = prompt(1, 27)
    table = [50, 3, 12, 7, 33, 21, 8]
    chunks = [paged.step([(tokens, start, min(5, len(tokens) - start), table)])[0]
              for start in range(0, len(tokens), 5)]
    torch.testing.assert_close(torch.cat(chunks), reference_logits(hf_llama, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("max_group_slots", [attention.MAX_GROUP_KV_SLOTS, 24])
def test_batch_mixing_decodes_and_prefill_chunks(
    paged: PagedModel, hf_llama: torch.nn.Module, max_group_slots: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A small gather budget splits both the decodes and the prefill chunks into several attention groups.
    monkeypatch.setattr(attention, "MAX_GROUP_KV_SLOTS", max_group_slots)
    decodes = [(prompt(10 + i, n), [1 + 8 * i + b for b in range(8)]) for i, n in enumerate((6, 13, 21))]
    prefills = [(prompt(20, 19), [40, 41, 60, 42, 43, 61]), (prompt(21, 11), [30, 29, 28, 27])]
    # Fill the decoding sequences' caches up to their last token (each alone, as earlier steps would).
    for tokens, table in decodes:
        paged.step([(tokens, 0, len(tokens) - 1, table)])
    # The first prefill already has 8 tokens cached (an earlier chunk); the second starts from scratch.
    paged.step([(prefills[0][0], 0, 8, prefills[0][1])])
    batch = [(tokens, len(tokens) - 1, 1, table) for tokens, table in decodes]
    batch += [(prefills[0][0], 8, 7, prefills[0][1]), (prefills[1][0], 0, 11, prefills[1][1])]
    results = paged.step(batch)
    assert len(paged.last_metadata.groups) == (2 if max_group_slots > 24 else 5)
    for (tokens, computed, new, _), logits in zip(batch, results, strict=True):
        expected = reference_logits(hf_llama, tokens[: computed + new])[computed:]
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_decode_group_with_different_context_lengths_and_the_same_block_count(
    paged: PagedModel, hf_llama: torch.nn.Module
) -> None:
    seqs = [(prompt(30 + i, n), [10 * i + b for b in range(1, 6)]) for i, n in enumerate((17, 18, 20))]
    for tokens, table in seqs:
        paged.step([(tokens, 0, len(tokens) - 1, table)])
    results = paged.step([(tokens, len(tokens) - 1, 1, table) for tokens, table in seqs])
    for (tokens, _), logits in zip(seqs, results, strict=True):
        torch.testing.assert_close(logits, reference_logits(hf_llama, tokens)[-1:], atol=ATOL, rtol=0)


def _tiny_hf_model(tmp_path: Path, config, model_cls) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(4.0 if param.dim() > 1 else 1.0).add_(0.1 * torch.randn_like(param) if param.dim() == 1 else 0)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path, model


TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)


def test_qwen2_attention_bias_matches_transformers(tmp_path: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model_dir, hf_model = _tiny_hf_model(tmp_path, Qwen2Config(**TINY, tie_word_embeddings=False), Qwen2ForCausalLM)
    assert hf_model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    paged = PagedModel(model_dir)
    tokens = prompt(2, 14, vocab=512)
    first, second = paged.step([(tokens, 0, 9, [7, 1, 4, 2])])[0], paged.step([(tokens, 9, 5, [7, 1, 4, 2])])[0]
    torch.testing.assert_close(torch.cat([first, second]), reference_logits(hf_model, tokens), atol=ATOL, rtol=0)


def test_llama3_rope_scaling_matches_transformers(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)
    config = LlamaConfig(**TINY, rope_scaling=scaling, rope_theta=500000.0)
    model_dir, hf_model = _tiny_hf_model(tmp_path, config, LlamaForCausalLM)
    paged = PagedModel(model_dir)
    assert paged.config.rope_scaling is not None and paged.config.rope_scaling["rope_type"] == "llama3"
    tokens = prompt(3, 60, vocab=512)
    (logits,) = paged.step([(tokens, 0, len(tokens), list(range(20, 35)))])
    torch.testing.assert_close(logits, reference_logits(hf_model, tokens), atol=ATOL, rtol=0)
