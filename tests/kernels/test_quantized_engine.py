"""SmolLM2 (the shipped Q4_1 GGUF) served with quantized weights against the same file dequantized, both in
float32: the quantized model's greedy choice at each position of the dequantized model's greedy continuations
(teacher-forced top-1 agreement, every matmul on the decode kernel: steps of at most 16 tokens), over a set
of prompts. gguf keeps the file's own weights, so only the int8 activations differ (as in llama.cpp); int8
re-quantizes the dequantized Q4_1 weights per channel on top of that. And where batches run as W8A8 (int8
copies of the weights, int8 activations per 64: VNNI at "avx512_bf16", int8 tiles at "amx", both in bfloat16;
AVX2's vpmaddubsw at "avx2", in float32), the same against the dequantized model in that dtype."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember import LLM, SamplingParams
from ember.kernels.build import compiler
from ember.kernels.cpu import cpu_isa_level, level_at_least

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4,",
    "Write a poem about the sea.",
    "SELECT name FROM users WHERE",
    "The three primary colors are",
    "To make a cup of tea, first",
]
NEW_TOKENS = 32
# The least share of positions where the quantized model's greedy token is the reference's. Measured on
# 2026-12-04 (AMX machine, VNNI kernel): gguf 248/256 = 0.969, int8 247/256 = 0.965; the integer dot
# products are exact on every ISA level, so the levels agree.
AGREEMENT_BOUNDS = {"gguf": 0.94, "int8": 0.94}
# The same for W8A8 batches in bfloat16 against the dequantized model in bfloat16: measured on 2026-12-05, Zen 4
# and Sapphire Rapids-class AMX machines: 240/256 = 0.938 at "avx512_bf16", 245/256 = 0.957 at "amx" (gguf in
# bfloat16 at the same level, whose batches run bfloat16 panels: 256/256).
W8A8_AGREEMENT_BOUND = 0.92
# The same for W8A8 batches in float32 at "avx2": measured on 2026-12-07, Zen 3 (AVX2 only): 241/256 = 0.941.
AVX2_W8A8_AGREEMENT_BOUND = 0.92

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        compiler() is None or not level_at_least(cpu_isa_level(), "avx2"),
        reason="quantized weights need a C compiler and AVX2",
    ),
]


def engine(model: Path, quantization: str, dtype: str = "float32", kernels: str = "auto",
           kv_cache_dtype: str = "auto") -> LLM:
    return LLM(
        str(model),
        dtype=dtype,
        kernels=kernels,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        num_threads=2,
        max_num_batched_tokens=16,
        max_num_seqs=len(PROMPTS),
        enable_prefix_caching=False,
    )


@pytest.fixture(scope="module")
def reference(smollm2_gguf_path: Path) -> list[list[int]]:
    """Each prompt's tokens followed by its greedy continuation on the dequantized model."""
    llm = engine(smollm2_gguf_path, "none")
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    return [output.prompt_token_ids + output.outputs[0].token_ids for output in outputs]


def greedy_agreement(llm: LLM, reference: list[list[int]]) -> float:
    """The share of the reference continuations' positions where `llm`'s top-1 token is the reference's."""
    scored = llm.generate(reference, SamplingParams(max_tokens=1, prompt_logprobs=0))
    agreed = total = 0
    for tokens, output in zip(reference, scored, strict=True):
        continuation = range(len(tokens) - NEW_TOKENS, len(tokens))
        agreed += sum(output.prompt_logprobs[i][tokens[i]].rank == 1 for i in continuation)
        total += NEW_TOKENS
    print(f"greedy agreement {agreed}/{total} = {agreed / total:.3f}")
    return agreed / total


@pytest.mark.parametrize("quantization", ["gguf", "int8"])
def test_greedy_agreement_with_the_dequantized_model(
    smollm2_gguf_path: Path, reference: list[list[int]], quantization: str
) -> None:
    llm = engine(smollm2_gguf_path, quantization)
    assert llm.engine.runner.kernel_paths["gemm"].startswith("native_quant_")
    assert greedy_agreement(llm, reference) >= AGREEMENT_BOUNDS[quantization]


@pytest.mark.parametrize("level", [level for level in ("amx", "avx512_bf16") if level_at_least(cpu_isa_level(), level)])
def test_w8a8_batches_agree_with_the_dequantized_model_in_bfloat16(smollm2_gguf_path: Path, level: str) -> None:
    """Steps of 16 rows on int8 copies of the weights with int8 activations for every step past the GEMV's 4 rows,
    so nearly every scored position: --quantization auto at "avx512_bf16" (VNNI); at "amx", whose auto runs
    prompt steps on the blocks' bfloat16 panels, --quantization int8 (the same int8 weights, on AMX's int8
    tiles)."""
    reference = engine(smollm2_gguf_path, "none", "bfloat16", level).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    reference = [output.prompt_token_ids + output.outputs[0].token_ids for output in reference]
    llm = engine(smollm2_gguf_path, "auto" if level == "avx512_bf16" else "int8", "bfloat16", level)
    assert {"amx": "w8a8_amx", "avx512_bf16": "w8a8_vnni"}[level] in llm.engine.runner.kernel_paths["gemm"]
    assert greedy_agreement(llm, reference) >= W8A8_AGREEMENT_BOUND


def test_w8a8_batches_agree_with_the_dequantized_model_in_float32_on_avx2(
    smollm2_gguf_path: Path, reference: list[list[int]]
) -> None:
    """--quantization auto in float32 at "avx2" (the default on CPUs without AVX-512): steps past the GEMV's 4
    rows, so nearly every scored position, on int8 copies of the weights with int8 activations."""
    llm = engine(smollm2_gguf_path, "auto", "float32", "avx2")
    assert "w8a8_avx2" in llm.engine.runner.kernel_paths["gemm"]
    assert greedy_agreement(llm, reference) >= AVX2_W8A8_AGREEMENT_BOUND
