"""SmolLM2 (the shipped Q4_1 GGUF) served with quantized weights against the same file dequantized, both in
float32: the quantized model's greedy choice at each position of the dequantized model's greedy continuations
(teacher-forced top-1 agreement, every matmul on the decode kernel: steps of at most 16 tokens), over a set
of prompts. gguf keeps the file's own weights, so only the int8 activations differ (as in llama.cpp); int8
re-quantizes the dequantized Q4_1 weights per channel on top of that."""

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

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        compiler() is None or not level_at_least(cpu_isa_level(), "avx2"),
        reason="quantized weights need a C compiler and AVX2",
    ),
]


def engine(model: Path, quantization: str) -> LLM:
    return LLM(
        str(model),
        dtype="float32",
        quantization=quantization,
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


@pytest.mark.parametrize("quantization", ["gguf", "int8"])
def test_greedy_agreement_with_the_dequantized_model(
    smollm2_gguf_path: Path, reference: list[list[int]], quantization: str
) -> None:
    llm = engine(smollm2_gguf_path, quantization)
    assert llm.engine.runner.kernel_paths["gemm"].startswith("native_quant_")
    scored = llm.generate(reference, SamplingParams(max_tokens=1, prompt_logprobs=0))
    agreed = total = 0
    for tokens, output in zip(reference, scored, strict=True):
        continuation = range(len(tokens) - NEW_TOKENS, len(tokens))
        agreed += sum(output.prompt_logprobs[i][tokens[i]].rank == 1 for i in continuation)
        total += NEW_TOKENS
    rate = agreed / total
    print(f"{quantization}: greedy agreement {agreed}/{total} = {rate:.3f}")
    assert rate >= AGREEMENT_BOUNDS[quantization]
