"""The decoder stack (every layer of a step in one native call: decoder_stack.c in bfloat16 with AMX or AVX512-BF16,
decoder_stack_f32.c in float32 at each ISA level this CPU runs) against the same native kernels called op by op:
the same kernels in the same order, so greedy tokens and logprobs must be identical, bit for bit. Likewise
decoder_stack_quant.c (quantized Linear weights, bfloat16: every step, the GEMV's and the dequantized panels'
row counts) and decoder_stack_quant_f32.c (float32: steps of up to GEMV_MAX_ROWS rows) against the op-by-op
quantized path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ember import LLM, SamplingParams
from ember.errors import EmberError
from ember.kernels.cpu import ISA_LEVELS, cpu_isa_level, level_at_least
from ember.kernels.native import load_native_kernels
from ember.kernels.quant_gemm import AMX_W8A8_MAX_ROWS, GEMV_MAX_ROWS, PANEL_GEMV_MAX_ROWS
from tests.conftest import build_tiny_model_dir

# head_dim 32 and widths that are whole AMX tiles: the smallest shape the native kernels take.
SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2)
# (dtype, --kernels): bfloat16 at each level with a bfloat16 stack (AMX tiles, AVX512-BF16 vectors), float32 at
# every level; those this CPU runs.
CASES = [("bfloat16", level) for level in ("amx", "avx512_bf16") if level_at_least(cpu_isa_level(), level)] + [
    ("float32", level) for level in ISA_LEVELS[1:] if level_at_least(cpu_isa_level(), level)
]


@pytest.fixture(scope="module")
def stack_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-stack"), seed=3, **SHAPE)


def skip_without_stack(dtype: str, kernels: str) -> None:
    try:
        native = load_native_kernels(kernels, torch.device("cpu"), getattr(torch, dtype), (128, 256), 32, 2)
    except EmberError:
        native = None
    if native is None or not native.has_decoder_stack:
        pytest.skip(f"no native {dtype} decoder stack at --kernels {kernels} here")


def count_stack_calls(llm: LLM) -> Callable[[], tuple[int, int]]:
    """From now on, count `llm`'s model steps and its decoder stack's calls: returns a function that reads
    (decoder stack calls, model steps)."""
    model = llm.engine.runner.model
    counts = {"calls": 0, "steps": 0}
    run_model, run_stack = model.forward, model.native.decoder_stack

    def counted_step(*args: object) -> torch.Tensor:
        counts["steps"] += 1
        return run_model(*args)

    def counted_stack(*args: object) -> torch.Tensor:
        counts["calls"] += 1
        return run_stack(*args)

    model.forward = counted_step
    model.native.decoder_stack = counted_stack  # this engine's own kernels object
    return lambda: (counts["calls"], counts["steps"])


def generate(model_dir: Path, dtype: str, kernels: str, use_stack: bool, prompts: list[list[int]],
             step_tokens: int, quantization: str = "none", kv_cache_dtype: str = "auto") -> tuple[list, int, int]:
    """(outputs, decoder stack calls, model steps)."""
    llm = LLM(str(model_dir), dtype=dtype, kernels=kernels, num_threads=2, enable_prefix_caching=False,
              max_num_seqs=len(prompts), max_num_batched_tokens=step_tokens, quantization=quantization,
              kv_cache_dtype=kv_cache_dtype)
    counts = count_stack_calls(llm)
    if not use_stack:
        native = llm.engine.runner.model.native
        # The layers keep their kernels (the op-by-op native path), their Linear layers on the stack's GEMM at
        # every row count: past gemm_max_rows they would run oneDNN's, whose order of sums varies by CPU.
        native.gemm_max_rows = native.decoder_stack_max_rows
        llm.engine.runner.model.native = None
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    outputs = [result.outputs[0] for result in llm.generate(prompts, params)]
    return outputs, *counts()


# 3 prompts in one prefill step, then decode steps; 40 prompts (decode batches of a full group of 32 rows plus
# a tail of 8) through 64-token steps: prompt chunks with cached context before them, decodes and chunks mixed.
@pytest.mark.parametrize(("dtype", "kernels"), CASES)
@pytest.mark.parametrize(("num_prompts", "step_tokens"), [(3, 1024), (40, 64)])
def test_decoder_stack_matches_op_by_op(stack_model_dir: Path, dtype: str, kernels: str, num_prompts: int,
                                        step_tokens: int) -> None:
    skip_without_stack(dtype, kernels)
    prompts = [[100 + (7 * i + j) % 900 for j in range(5 + 9 * (i % 5))] for i in range(num_prompts)]
    reference, _, _ = generate(stack_model_dir, dtype, kernels, False, prompts, step_tokens)
    stacked, calls, steps = generate(stack_model_dir, dtype, kernels, True, prompts, step_tokens)
    assert calls == steps >= 12  # every step, prefill and mixed ones included, ran as one native call
    assert_same_outputs(reference, stacked)


# The stacks built for an int8 KV cache (kv_cache.h) against the op-by-op path over the same cache: float weights
# at every level, and quantized ones (int8, then the GEMV and panels) in bfloat16; decodes and prompt chunks with
# cached context before them in 16-row steps.
@pytest.mark.parametrize(("dtype", "kernels", "quantization"), [*((dtype, kernels, "none") for dtype, kernels in CASES),
                         *(("bfloat16", kernels, "int8") for dtype, kernels in CASES if dtype == "bfloat16")])
def test_decoder_stack_over_an_int8_kv_cache_matches_op_by_op(stack_model_dir: Path, dtype: str, kernels: str,
                                                              quantization: str) -> None:
    skip_without_stack(dtype, kernels)
    prompts = [[100 + (7 * i + j) % 900 for j in range(5 + 9 * (i % 5))] for i in range(6)]
    reference, _, _ = generate(stack_model_dir, dtype, kernels, False, prompts, 16, quantization, "int8")
    stacked, calls, steps = generate(stack_model_dir, dtype, kernels, True, prompts, 16, quantization, "int8")
    assert calls == steps >= 11
    assert_same_outputs(reference, stacked)


def assert_same_outputs(expected_outputs: list, got_outputs: list) -> None:
    for expected, got in zip(expected_outputs, got_outputs, strict=True):
        assert got.token_ids == expected.token_ids
        assert [{t: lp.logprob for t, lp in step.items()} for step in got.logprobs] == [
            {t: lp.logprob for t, lp in step.items()} for step in expected.logprobs
        ]


# int8 weights (per output row) on the tiny model, at each bfloat16 level (panels on AMX tiles or AVX512-BF16
# vectors); the real GGUF's Q4_1/Q8_0 blocks: below and tests/kernels/test_quantized_engine.py. 3 prompts: a
# 42-row prefill step (panels), then decode steps of 3 rows (the GEMV); 6 prompts through 16-row steps: prompt
# chunks mixed with decodes, on both sides of PANEL_GEMV_MAX_ROWS.
@pytest.mark.parametrize("kernels", [level for dtype, level in CASES if dtype == "bfloat16"])
@pytest.mark.parametrize(("num_prompts", "step_tokens"), [(3, 1024), (6, GEMV_MAX_ROWS)])
def test_quantized_decoder_stack_matches_op_by_op(
    stack_model_dir: Path, kernels: str, num_prompts: int, step_tokens: int
) -> None:
    skip_without_stack("bfloat16", kernels)
    prompts = [[100 + (7 * i + j) % 900 for j in range(5 + 9 * (i % 5))] for i in range(num_prompts)]
    reference, _, _ = generate(stack_model_dir, "bfloat16", kernels, False, prompts, step_tokens, "int8")
    stacked, calls, steps = generate(stack_model_dir, "bfloat16", kernels, True, prompts, step_tokens, "int8")
    assert calls == steps >= 11
    assert_same_outputs(reference, stacked)
    llm = LLM(str(stack_model_dir), kernels=kernels, num_threads=2, quantization="int8")
    assert llm.engine.runner.kernel_paths["decoder_stack"] == f"native_{kernels}_quant (every step)"
    quant_gemm = llm.engine.runner.quant_gemm
    w8a8 = f", int8 weights with int8 activations per 64 ({quant_gemm.w8a8_name})" if quant_gemm.panel_w8a8 else ""
    assert llm.engine.runner.kernel_paths["gemm"] == (
        f"native_quant_{kernels} (int8, {quant_gemm.dot_product}; up to {PANEL_GEMV_MAX_ROWS} rows, else bfloat16 "
        f"panels on {kernels}{w8a8})"
    )


@pytest.mark.parametrize("kernels", [level for dtype, level in CASES if dtype == "float32"])
def test_float32_quantized_decoder_stack_matches_op_by_op(stack_model_dir: Path, kernels: str) -> None:
    """decoder_stack_quant_f32.c (a float32 model with quantized weights, for CPUs without native bfloat16) against
    the op-by-op quantized float32 path at each ISA level: prompt chunks and decodes in 16-row steps, every step in
    the stack."""
    skip_without_stack("float32", kernels)
    prompts = [[100 + (7 * i + j) % 900 for j in range(5 + 9 * (i % 5))] for i in range(6)]
    reference, _, _ = generate(stack_model_dir, "float32", kernels, False, prompts, GEMV_MAX_ROWS, "int8")
    outputs, calls, steps = generate(stack_model_dir, "float32", kernels, True, prompts, GEMV_MAX_ROWS, "int8")
    assert calls == steps >= 11
    assert_same_outputs(reference, outputs)
    llm = LLM(str(stack_model_dir), dtype="float32", kernels=kernels, num_threads=2, quantization="int8")
    level = llm.engine.runner.native.vector_isa
    assert llm.engine.runner.kernel_paths["decoder_stack"] == (
        f"native_{level}_quant (steps of up to {GEMV_MAX_ROWS} rows; larger ones op by op)"
    )


@pytest.mark.slow
def test_quantized_decoder_stack_matches_op_by_op_on_smollm2_gguf(smollm2_gguf_path: Path) -> None:
    """The shipped GGUF's own Q4_1/Q8_0 blocks (quantization gguf), 4 prompts through 64-row steps: every step
    in the stack, the GEMV's and the panels' row counts."""
    skip_without_stack("bfloat16", "native")
    prompts = [[100 + (7 * i + j) % 900 for j in range(5 + 9 * i)] for i in range(4)]
    reference, _, _ = generate(smollm2_gguf_path, "bfloat16", "native", False, prompts, 64, "gguf")
    stacked, calls, steps = generate(smollm2_gguf_path, "bfloat16", "native", True, prompts, 64, "gguf")
    assert calls == steps >= 11
    assert_same_outputs(reference, stacked)


@pytest.mark.slow
@pytest.mark.parametrize("kernels", [level for dtype, level in CASES if dtype == "bfloat16"])
def test_auto_quantization_runs_the_blocks_for_small_decodes_and_other_tables_for_the_rest(
    smollm2_gguf_path: Path, kernels: str
) -> None:
    """--quantization auto (the default) on the shipped GGUF in 64-row steps, 4 prompts then 6 (decode steps of 4
    and of 6 rows): decode steps of up to PANEL_GEMV_MAX_ROWS rows run the quantized stack's GEMV on the blocks,
    larger ones the int8 copies with int8 activations (W8A8), and steps with prompt tokens:
    - at avx512_bf16 (VNNI), the int8 copies too: bit for bit the op-by-op path on the same weights;
    - with AMX, whose int8 tiles lose to its bfloat16 ones past AMX_W8A8_MAX_ROWS, the blocks' bfloat16 panels,
      as --quantization gguf's prompt steps (op by op, Linears pick by rows alone).
    Either way the first tokens are gguf's (with AMX, bit for bit)."""
    skip_without_stack("bfloat16", kernels)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    for num_prompts in (4, 6):
        prompts = [[100 + (7 * i + j) % 900 for j in range(5 + 9 * i)] for i in range(num_prompts)]
        gguf, _, _ = generate(smollm2_gguf_path, "bfloat16", kernels, True, prompts, 64, "gguf")
        llm = LLM(str(smollm2_gguf_path), kernels=kernels, num_threads=2, enable_prefix_caching=False,
                  max_num_seqs=num_prompts, max_num_batched_tokens=64)
        model = llm.engine.runner.model
        stack, ran = model.native.decoder_stack, []
        model.native.decoder_stack = lambda *args, ran=ran, stack=stack: ran.append(args[0].data_ptr()) or stack(*args)
        auto = [result.outputs[0] for result in llm.generate(prompts, params)]
        choices = [choice[1].data_ptr() for choice in model._stack_layers[1].choices]
        quant_gemm, paths = llm.engine.runner.quant_gemm, llm.engine.runner.kernel_paths
        used = {choices.index(table) for table in ran}
        # With 4 prompts the first tokens come from prompt steps whose logits rows are few enough for the LM
        # head's GEMV in both runs; later tokens of these random prompts can go another way at near ties.
        for g, a in zip(gguf, auto if num_prompts == 4 else [], strict=False):
            # The same token, unless gguf's logits tied it with auto's at bfloat16's resolution (it takes the first).
            top = g.logprobs[0][g.token_ids[0]].logprob
            tied = a.token_ids[0] in g.logprobs[0] and g.logprobs[0][a.token_ids[0]].logprob == top
            assert g.token_ids[0] == a.token_ids[0] or tied
            assert a.logprobs[0][a.token_ids[0]].logprob == pytest.approx(g.logprobs[0][g.token_ids[0]].logprob, abs=0.3)
            if quant_gemm.w8a8_name == "w8a8_amx":  # the same panels: bit for bit
                assert a.logprobs[0] == g.logprobs[0]
        if quant_gemm.w8a8_name == "w8a8_vnni":  # [blocks (decodes), int8 copies]
            assert used == {0, 1} if num_prompts == 4 else 1 in used
            op_by_op, _, _ = generate(smollm2_gguf_path, "bfloat16", kernels, False, prompts, 64, "auto")
            assert_same_outputs(op_by_op, auto)
            assert paths["decoder_stack"] == (f"native_{kernels}_quant (every step: the blocks up to "
                                              f"{PANEL_GEMV_MAX_ROWS} rows, else the int8 copies)")
            assert paths["gemm"].endswith(f"up to {PANEL_GEMV_MAX_ROWS} rows, else int8 copies of the weights with "
                                          f"int8 activations per 64 (w8a8_vnni))")
        else:  # [blocks (decodes), int8 copies (decodes), the blocks' panels]
            assert quant_gemm.w8a8_name == "w8a8_amx"
            assert used == {0, 2} if num_prompts == 4 else {1, 2} <= used  # 6 rows: the int8 copies
            assert paths["decoder_stack"] == (
                f"native_{kernels}_quant (every step: decode steps on the blocks up to {PANEL_GEMV_MAX_ROWS} rows, "
                f"else the int8 copies up to {AMX_W8A8_MAX_ROWS}; steps with prompt tokens and larger ones on the "
                f"blocks' panels)")
            assert paths["gemm"].endswith(
                f"up to {PANEL_GEMV_MAX_ROWS} rows, else int8 copies of the weights with int8 activations per 64 "
                f"(w8a8_amx) up to {AMX_W8A8_MAX_ROWS} rows, then bfloat16 panels on amx)")


@pytest.mark.slow
@pytest.mark.parametrize("tail", [1, 3])
def test_auto_quantization_answers_a_repeated_prompt_alike_from_the_prefix_cache(
    smollm2_gguf_path: Path, tail: int
) -> None:
    """--quantization auto: a prompt of 2 blocks and `tail` tokens, asked twice. The second time only its tail is
    computed (a step of 1 or 3 rows, within the blocks' GEMV), yet steps that compute prompt tokens run the table
    that takes any rows (int8 copies, or with AMX the blocks' panels) whatever their size, and attention takes a
    lone prompt token as a chunk (with AMX, its tiles score chunks): the same tokens and logprobs, bit for bit, as
    the first time (before either, they differed here)."""
    skip_without_stack("bfloat16", "native")
    llm = LLM(str(smollm2_gguf_path), num_threads=2, enable_prefix_caching=True)
    prompt = [100 + (11 * j) % 900 for j in range(2 * 16 + tail)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    first, second = (llm.generate([prompt], params)[0] for _ in range(2))
    assert second.num_cached_tokens == 32
    assert_same_outputs([first.outputs[0]], [second.outputs[0]])
