"""Greedy decoding in float32 on ember's native float32 kernels (every step one decoder stack call:
decoder_stack_f32.c with f32_gemm.c), forced to each ISA level this CPU can run, against the same engine on
PyTorch ops only (oneDNN's GEMMs): token for token the same (float32 noise cannot flip a greedy choice here),
with prompt chunks and decode steps mixed in one step."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember import LLM, SamplingParams
from ember.kernels.build import compiler
from ember.kernels.cpu import ISA_LEVELS, cpu_isa_level, level_at_least
from ember.kernels.native import ANY_ROWS
from ember.kernels.quant_gemm import AVX2_W8A8_GEMV_MAX_ROWS
from tests.conftest import build_tiny_model_dir
from tests.kernels.test_decoder_stack import count_stack_calls

LEVELS = [level for level in ISA_LEVELS[1:] if level_at_least(cpu_isa_level(), level)]
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,", "1, 2, 3, 4,",
         "Write a poem about the sea.", "SELECT name FROM users WHERE"]


def greedy_tokens(model: Path, kernels: str, max_tokens: int) -> list[list[int]]:
    # A 32-token step budget splits the longer prompts into chunks that share steps with decodes. The float
    # kernels on the GGUF's weights dequantized at load (auto's decode rows would read its blocks).
    llm = LLM(str(model), dtype="float32", kernels=kernels, num_threads=2, enable_prefix_caching=False,
              max_num_seqs=4, max_num_batched_tokens=32, quantization="none")
    paths = llm.engine.runner.kernel_paths
    native = kernels != "torch"
    expected = paths["attention_decode"] if native else "torch"
    assert expected.startswith("native_" if native else "torch")
    assert paths["gemm"].startswith(expected) and paths["decoder_stack"].startswith(expected if native else "off")
    counts = count_stack_calls(llm) if native else None
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokens = [result.outputs[0].token_ids for result in llm.generate(TEXTS, params)]
    if counts is not None:
        calls, steps = counts()
        assert calls == steps >= max_tokens  # every step ran as one decoder stack call
    return tokens


@pytest.fixture(scope="module")
def tiny_32_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if compiler() is None or not LEVELS:
        pytest.skip("the float32 kernels need a C compiler and AVX2")
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-f32"), seed=5, hidden_size=128,
                                intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def tiny_reference(tiny_32_dir: Path) -> list[list[int]]:
    return greedy_tokens(tiny_32_dir, "torch", 40)


@pytest.mark.parametrize("level", LEVELS)
def test_tiny_model_greedy_is_token_exact(tiny_32_dir: Path, tiny_reference: list[list[int]], level: str) -> None:
    assert greedy_tokens(tiny_32_dir, level, 40) == tiny_reference


def test_avx2_runs_steps_of_many_rows_op_by_op(tiny_32_dir: Path) -> None:
    if "avx2" not in LEVELS:
        pytest.skip("no AVX2")
    llm = LLM(str(tiny_32_dir), dtype="float32", kernels="avx2", num_threads=2, enable_prefix_caching=False,
              max_num_seqs=len(TEXTS), max_num_batched_tokens=1024)
    counts = count_stack_calls(llm)
    prompts = [[100 + (7 * i + j) % 900 for j in range(30)] for i in range(4)]  # one prefill step of 120 rows
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    calls, steps = counts()
    assert steps == 5 and calls == 4  # the prefill step op by op, the 4-row decode steps in the stack


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_gguf_path: Path) -> list[list[int]]:
    if compiler() is None or not LEVELS:
        pytest.skip("the float32 kernels need a C compiler and AVX2")
    return greedy_tokens(smollm2_gguf_path, "torch", 24)


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_smollm2_greedy_is_token_exact(smollm2_gguf_path: Path, smollm2_reference: list[list[int]],
                                       level: str) -> None:
    assert greedy_tokens(smollm2_gguf_path, level, 24) == smollm2_reference


@pytest.mark.slow
def test_smollm2_auto_quantization_in_float32_reads_the_blocks_for_decodes(smollm2_gguf_path: Path) -> None:
    """--quantization auto in float32 (CPUs without native bfloat16 default to it), forced to AVX2: steps of up to
    4 rows run decoder_stack_quant_f32.c's GEMV on the Q4_1/Q8_0 blocks, larger ones the same stack on int8
    copies of the weights with int8 activations (w8a8_f32_gemm.c)."""
    if compiler() is None or "avx2" not in LEVELS:
        pytest.skip("the float32 kernels need a C compiler and AVX2")
    llm = LLM(str(smollm2_gguf_path), dtype="float32", kernels="avx2", num_threads=2, enable_prefix_caching=False,
              max_num_seqs=2, max_num_batched_tokens=64)
    paths = llm.engine.runner.kernel_paths
    assert paths["gemm"] == ("native_quant_avx2 (q4_1+q8_0, avx2_maddubs; up to 4 rows, else int8 copies of the "
                             "weights with int8 activations per 64 (w8a8_avx2))")
    assert paths["decoder_stack"] == ("native_avx2_quant (every step: the blocks up to 4 rows, else the int8 "
                                      "copies)")
    model = llm.engine.runner.model
    stack = model.native.decoder_stack
    tables = []
    model.native.decoder_stack = lambda *args: tables.append(args[0].data_ptr()) or stack(*args)
    prompts = ["The capital of France is", "Once upon a time, in a land far away, there lived a king who"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    assert "Paris" in outputs[0].outputs[0].text
    most_rows = {table.data_ptr(): rows for rows, table, _ in model._stack_layers[1].choices}
    assert sorted({most_rows[table] for table in tables}) == [AVX2_W8A8_GEMV_MAX_ROWS, ANY_ROWS]
