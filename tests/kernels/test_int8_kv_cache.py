"""The int8 KV cache (`--kv-cache-dtype int8`, ember/layers/kv_cache.py): its quantization, the native cache
writes against PyTorch's (the same bytes), and attention over it, native at each ISA level this CPU runs and
PyTorch's gather + SDPA, against exact attention over the dequantized K/V. And SmolLM2 with its defaults and an
int8 cache against the same with the model dtype's cache: teacher-forced greedy agreement."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ember import SamplingParams
from ember.kernels.build import compiler
from ember.kernels.cpu import ISA_LEVELS, cpu_isa_level, level_at_least
from ember.kernels.native import NativeKernels, load_native_kernels
from ember.layers.attention import PagedAttention, SequenceSpan, build_attention_metadata
from ember.layers.kv_cache import (
    allocate_kv_cache,
    gather_blocks,
    int8_row_bytes,
    int8_views,
    quantize_kv,
    write_kv,
)
from ember.layers.rotary import RotaryEmbedding, apply_rotary
from tests.kernels.test_native_kernels import (
    BLOCK,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    exact_chunk_attention,
    scrambled_block_tables,
)
from tests.kernels.test_quantized_engine import NEW_TOKENS, PROMPTS, engine, greedy_agreement

CPU = torch.device("cpu")
# (dtype, ISA level) pairs of native kernels this CPU runs: bfloat16 from AVX-512 up, float32 from AVX2 up.
CASES = [("bfloat16", level) for level in ISA_LEVELS[1:] if level_at_least(level, "avx512")] + [
    ("float32", level) for level in ISA_LEVELS[1:]
]
CASES = [case for case in CASES if level_at_least(cpu_isa_level(), case[1])]
# The least share of positions where SmolLM2 with an int8 KV cache picks the greedy token of the model dtype's
# cache (teacher-forced, 8 prompts x 32 tokens; quantization and kernels auto). Measured on 2026-12-07, Zen 4
# (AVX512-BF16): bfloat16 245/256 = 0.957, float32 246/256 = 0.961 (W8A8 batches against bfloat16 panels, a
# change of summation order and rounding alone: 0.938; tests/kernels/test_quantized_engine.py).
INT8_KV_AGREEMENT_BOUNDS = {"bfloat16": 0.93, "float32": 0.93}


def test_quantize_kv_scales_each_head_by_its_largest_magnitude() -> None:
    kv = torch.tensor([[[[0.5, -1.27, 0.0, 1.0]], [[0.0, 0.0, 0.0, 0.0]]]])  # [1 token, K/V, 1 head, 4]
    values, scales = quantize_kv(kv)
    assert scales.tolist() == [[[pytest.approx(0.01)], [0.0]]]
    assert values.dtype == torch.int8
    assert values[0, 0, 0].tolist() == [50, -127, 0, 100]
    assert values[0, 1, 0].tolist() == [0, 0, 0, 0]  # a head of zeros stays zeros (no division by 0)


def test_quantization_error_is_at_most_half_a_step() -> None:
    kv = torch.randn(50, 2, KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(0)) * 3
    values, scales = quantize_kv(kv)
    error = (values.float() * scales.unsqueeze(-1) - kv).abs()
    assert (error <= scales.unsqueeze(-1) * 0.5 * (1 + 1e-6)).all()
    assert values.abs().max() == 127


def test_write_then_gather_round_trips_through_the_int8_rows() -> None:
    cache = allocate_kv_cache(2, 6, BLOCK, KV_HEADS, HEAD_DIM, torch.bfloat16, "int8", CPU)[1]
    assert cache.shape == (6, BLOCK, int8_row_bytes(KV_HEADS, HEAD_DIM)) and cache.dtype == torch.int8
    assert int8_row_bytes(KV_HEADS, HEAD_DIM) == 2 * KV_HEADS * HEAD_DIM + 2 * KV_HEADS * 4
    generator = torch.Generator().manual_seed(1)
    k, v = (torch.randn(20, KV_HEADS, HEAD_DIM, generator=generator).bfloat16() for _ in range(2))
    slots = torch.randperm(6 * BLOCK, generator=generator)[:20]
    write_kv(cache, slots, k, v)
    values, scales = int8_views(cache, KV_HEADS, HEAD_DIM)
    expected_values, expected_scales = quantize_kv(torch.stack((k, v), dim=1))
    assert torch.equal(values[slots], expected_values) and torch.equal(scales[slots], expected_scales)
    gathered = gather_blocks(cache, torch.arange(6), KV_HEADS, HEAD_DIM, torch.float32)
    assert gathered.shape == (6 * BLOCK, 2, KV_HEADS, HEAD_DIM)
    assert torch.equal(gathered[slots], expected_values.float() * expected_scales.unsqueeze(-1))
    untouched = torch.ones(6 * BLOCK, dtype=torch.bool)
    untouched[slots] = False
    assert not gathered[untouched].any()  # zeroed slots dequantize to zeros


@pytest.fixture(scope="module", params=CASES or [pytest.param(("none", "none"), marks=pytest.mark.skip("no AVX2"))],
                ids=lambda case: f"{case[0]}-{case[1]}")
def native(request: pytest.FixtureRequest) -> NativeKernels:
    if compiler() is None:
        pytest.skip("no C compiler")
    dtype, level = request.param
    kernels = load_native_kernels(level, CPU, getattr(torch, dtype), (576, 1536), HEAD_DIM, HEADS // KV_HEADS,
                                  "int8")
    assert kernels.level == level and kernels.kv_cache_element == torch.int8
    return kernels


def int8_cache_with_tables(lengths: list[int], seed: int, dtype: torch.dtype
                           ) -> tuple[list[list[int]], torch.Tensor]:
    """Block tables for sequences of `lengths` tokens over shuffled physical blocks, and an int8 cache whose
    every slot holds random K/V quantized."""
    tables, num_blocks = scrambled_block_tables(lengths, seed)
    cache = allocate_kv_cache(1, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype, "int8", CPU)[0]
    generator = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(num_blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=generator).to(dtype) for _ in range(2))
    write_kv(cache, torch.arange(num_blocks * BLOCK), k, v)
    return tables, cache


def dequantized(cache: torch.Tensor) -> torch.Tensor:
    """An int8 cache as float32 [blocks, BLOCK, 2, kv_heads, D]: what exact attention reads."""
    blocks = cache.shape[0]
    return gather_blocks(cache, torch.arange(blocks), KV_HEADS, HEAD_DIM, torch.float32).view(
        blocks, BLOCK, 2, KV_HEADS, HEAD_DIM)


def random_q(rows: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """q [rows, heads, D] as strided views of qkv rows, as in the model."""
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=torch.Generator().manual_seed(seed))
    return qkv.to(dtype)[:, : HEADS * HEAD_DIM].view(-1, HEADS, HEAD_DIM)


def bound(exact: torch.Tensor, dtype: torch.dtype) -> float:
    # bfloat16 output: half a unit in its last place; float32: float32 sums in another order.
    return float(exact.abs().max()) * (2**-8 if dtype == torch.bfloat16 else 1e-5) + 1e-6


def test_rotary_and_cache_writes_what_write_kv_writes(native: NativeKernels) -> None:
    """The native RoPE + cache write quantizes the rotated k and v to the same int8 values and scales, bit for
    bit, as the PyTorch path (PagedAttention's write_kv)."""
    dtype = native.dtype
    rotary = RotaryEmbedding(HEAD_DIM, 4096, 10000.0, None, dtype, CPU)
    tokens = 21
    generator = torch.Generator().manual_seed(2)
    cos, sin = rotary(torch.randint(0, 4096, (tokens,), generator=generator))
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=generator).to(dtype)
    qk_size = (HEADS + KV_HEADS) * HEAD_DIM
    rotated = apply_rotary(qkv[:, :qk_size].view(tokens, -1, HEAD_DIM), cos, sin)
    slots = torch.randperm(8 * BLOCK, generator=generator)[:tokens]
    expected = allocate_kv_cache(1, 8, BLOCK, KV_HEADS, HEAD_DIM, dtype, "int8", CPU)[0]
    write_kv(expected, slots, rotated[:, HEADS:], qkv[:, qk_size:].view(tokens, KV_HEADS, HEAD_DIM))
    cache = torch.zeros_like(expected)
    native.rotary_and_cache(qkv, cos, sin, slots, cache, HEADS)
    if dtype == torch.bfloat16:  # float32's RoPE rounds as apply_rotary does to within an ulp, not bit for bit
        assert torch.equal(cache, expected)
    values, scales = int8_views(cache, KV_HEADS, HEAD_DIM)
    expected_values, expected_scales = int8_views(expected, KV_HEADS, HEAD_DIM)
    assert (values.int() - expected_values.int()).abs().max() <= 1
    assert torch.allclose(scales, expected_scales, rtol=1e-6)


def test_a_cache_of_another_element_type_is_refused(native: NativeKernels) -> None:
    q = random_q(1, native.dtype, 0)
    cache = torch.zeros(2, BLOCK, 2, KV_HEADS, HEAD_DIM, dtype=native.dtype)
    with pytest.raises(ValueError, match="KV cache"):
        native.paged_decode_attention(q, cache, torch.zeros(1, 1, dtype=torch.int64),
                                      torch.ones(1, dtype=torch.int64), HEAD_DIM**-0.5)


@pytest.mark.parametrize("context_lens", [[1, 15, 16, 17, 200, 333], [1], [40], [7] * 9])
def test_decode_attention_over_int8_matches_exact_attention(native: NativeKernels, context_lens: list[int]) -> None:
    """Scrambled block tables, contexts ending anywhere in a block; one sequence (split by KV head) too."""
    dtype = native.dtype
    tables, cache = int8_cache_with_tables(context_lens, 3, dtype)
    max_blocks = max(len(table) for table in tables)
    block_tables = torch.tensor([table + [0] * (max_blocks - len(table)) for table in tables])
    q = random_q(len(context_lens), dtype, 4)
    out = native.paged_decode_attention(q, cache, block_tables, torch.tensor(context_lens), HEAD_DIM**-0.5)

    decodes = [(n - 1, 1) for n in context_lens]  # one query at the last position of each sequence
    for row, case, exact in exact_chunk_attention(q, dequantized(cache), decodes, tables):
        assert (out[row].double() - exact).abs().max() <= bound(exact, dtype), case


@pytest.mark.parametrize("chunks", [
    [(0, 2), (0, 17), (5, 40), (33, 16), (100, 37), (0, 200), (190, 64)],  # (tokens cached, new tokens)
    [(47, 3)], [(0, 1)], [(40, 33)],
])
def test_prefill_attention_over_int8_matches_exact_attention(native: NativeKernels,
                                                             chunks: list[tuple[int, int]]) -> None:
    dtype = native.dtype
    tables, cache = int8_cache_with_tables([cached + new for cached, new in chunks], 5, dtype)
    max_blocks = max(len(table) for table in tables)
    block_tables = torch.tensor([table + [0] * (max_blocks - len(table)) for table in tables])
    query_starts = torch.tensor([0, *np.cumsum([new for _, new in chunks])])
    context_lens = torch.tensor([cached + new for cached, new in chunks])
    q = random_q(int(query_starts[-1]), dtype, 6)
    out = native.paged_prefill_attention(q, cache, block_tables, query_starts, context_lens, HEAD_DIM**-0.5)

    for row, case, exact in exact_chunk_attention(q, dequantized(cache), chunks, tables):
        assert (out[row].double() - exact).abs().max() <= bound(exact, dtype), case


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pytorch_attention_over_int8_matches_exact_attention(dtype: torch.dtype) -> None:
    """Without native kernels: PagedAttention quantizes this step's K/V into the cache and attends over the
    gathered blocks, dequantized (decodes and prompt chunks in one step)."""
    decodes, chunks = [30, 17], [(5, 12), (0, 9)]
    lengths = decodes + [cached + new for cached, new in chunks]
    tables, cache = int8_cache_with_tables(lengths, 7, dtype)
    spans = [SequenceSpan(n - 1, 1, table) for n, table in zip(decodes, tables[: len(decodes)], strict=True)]
    spans += [SequenceSpan(cached, new, table, prompt=True)
              for (cached, new), table in zip(chunks, tables[len(decodes):], strict=True)]
    rows = len(decodes) + sum(new for _, new in chunks)
    generator = torch.Generator().manual_seed(8)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=generator).to(dtype)
    q = qkv[:, : HEADS * HEAD_DIM].view(-1, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(-1, KV_HEADS, HEAD_DIM)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(-1, KV_HEADS, HEAD_DIM)
    meta = build_attention_metadata(spans, BLOCK, dtype, CPU)
    out = PagedAttention(HEADS, KV_HEADS, HEAD_DIM)(q, k, v, cache, meta)

    flat = dequantized(cache)
    decode_part = [(n - 1, 1) for n in decodes]
    for row, case, exact in exact_chunk_attention(q, flat, decode_part + chunks, tables):
        # SDPA over K/V dequantized to `dtype`: bfloat16's rounding of them and of P, within 2 ulps.
        tolerance = float(exact.abs().max()) * (2**-6 if dtype == torch.bfloat16 else 1e-5) + 1e-6
        assert (out[row].double() - exact).abs().max() <= tolerance, case


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_int8_kv_cache_agrees_with_the_model_dtypes_cache_on_smollm2(smollm2_gguf_path: Path, dtype: str) -> None:
    """The shipped model with the defaults for `dtype` (quantization and kernels auto), prompt chunks of 16 tokens
    reading the earlier chunks' K/V from the cache."""
    if dtype == "bfloat16" and not level_at_least(cpu_isa_level(), "avx512"):
        pytest.skip("bfloat16 runs on the native kernels from AVX-512 up")
    reference = engine(smollm2_gguf_path, "auto", dtype).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    reference = [output.prompt_token_ids + output.outputs[0].token_ids for output in reference]
    llm = engine(smollm2_gguf_path, "auto", dtype, kv_cache_dtype="int8")
    assert llm.engine.runner.kv_cache.dtype == torch.int8
    assert greedy_agreement(llm, reference) >= INT8_KV_AGREEMENT_BOUNDS[dtype]
