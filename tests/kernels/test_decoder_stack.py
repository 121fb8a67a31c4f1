"""decoder_stack.c (every layer of a step in one native call) against the same native kernels called op by op:
the same kernels in the same order, so greedy tokens and logprobs must be identical, bit for bit. Likewise
decoder_stack_quant.c (quantized Linear weights) against the op-by-op quantized path, for the steps it takes
(up to GEMV_MAX_ROWS rows)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ember import LLM, SamplingParams
from ember.kernels.native import load_native_kernels
from ember.kernels.quant_gemm import GEMV_MAX_ROWS
from tests.conftest import build_tiny_model_dir

# head_dim 32 and widths that are whole AMX tiles: the smallest shape the native kernels take.
SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2)


@pytest.fixture(scope="module")
def decoder_stack_runs() -> None:
    kernels = load_native_kernels("auto", torch.device("cpu"), torch.bfloat16, (128, 256), 32, 2)
    if kernels is None or not kernels.has_decoder_stack:
        pytest.skip("the decoder stack needs the native kernels and AMX")


@pytest.fixture(scope="module")
def stack_model_dir(decoder_stack_runs: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-stack"), seed=3, **SHAPE)


def generate(model_dir: Path, use_stack: bool, prompts: list[list[int]], step_tokens: int,
             quantization: str = "none") -> tuple[list, int, int]:
    """(outputs, decoder stack calls, model steps)."""
    llm = LLM(str(model_dir), dtype="bfloat16", kernels="native", num_threads=2, enable_prefix_caching=False,
              max_num_seqs=len(prompts), max_num_batched_tokens=step_tokens, quantization=quantization)
    model = llm.engine.runner.model
    calls = steps = 0
    run_model = model.forward

    def counted_step(*args: object) -> torch.Tensor:
        nonlocal steps
        steps += 1
        return run_model(*args)

    model.forward = counted_step
    if use_stack:
        run_stack = model.native.decoder_stack

        def counted(*args: object) -> torch.Tensor:
            nonlocal calls
            calls += 1
            return run_stack(*args)

        model.native.decoder_stack = counted  # this engine's own kernels object
    else:
        model.native = None  # the layers keep their kernels: the op-by-op native path
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    outputs = [result.outputs[0] for result in llm.generate(prompts, params)]
    return outputs, calls, steps


# 3 prompts in one prefill step, then decode steps; 40 prompts (decode batches of a full group of 32 rows plus
# a tail of 8) through 64-token steps: prompt chunks with cached context before them, decodes and chunks mixed.
@pytest.mark.parametrize(("num_prompts", "step_tokens"), [(3, 1024), (40, 64)])
def test_decoder_stack_matches_op_by_op(stack_model_dir: Path, num_prompts: int, step_tokens: int) -> None:
    prompts = [[100 + (7 * i + j) % 900 for j in range(5 + 9 * (i % 5))] for i in range(num_prompts)]
    reference, _, _ = generate(stack_model_dir, False, prompts, step_tokens)
    stacked, calls, steps = generate(stack_model_dir, True, prompts, step_tokens)
    assert calls == steps >= 12  # every step, prefill and mixed ones included, ran as one native call
    assert_same_outputs(reference, stacked)


def assert_same_outputs(expected_outputs: list, got_outputs: list) -> None:
    for expected, got in zip(expected_outputs, got_outputs, strict=True):
        assert got.token_ids == expected.token_ids
        assert [{t: lp.logprob for t, lp in step.items()} for step in got.logprobs] == [
            {t: lp.logprob for t, lp in step.items()} for step in expected.logprobs
        ]


# int8 weights (per output row) on the tiny model; the real GGUF's Q4_1/Q8_0 blocks: tests/kernels/
# test_quantized_engine.py. 3 prompts: a 42-row prefill step (op by op: past GEMV_MAX_ROWS), then decode steps of
# 3 rows; 6 prompts through 16-row steps: prompt chunks, mixed with decodes, all in the stack.
@pytest.mark.parametrize(("num_prompts", "step_tokens", "op_by_op_steps"), [(3, 1024, 1), (6, GEMV_MAX_ROWS, 0)])
def test_quantized_decoder_stack_matches_op_by_op(
    stack_model_dir: Path, num_prompts: int, step_tokens: int, op_by_op_steps: int
) -> None:
    prompts = [[100 + (7 * i + j) % 900 for j in range(5 + 9 * (i % 5))] for i in range(num_prompts)]
    reference, _, _ = generate(stack_model_dir, False, prompts, step_tokens, "int8")
    stacked, calls, steps = generate(stack_model_dir, True, prompts, step_tokens, "int8")
    assert calls == steps - op_by_op_steps >= 11
    assert_same_outputs(reference, stacked)


@pytest.mark.slow
def test_quantized_decoder_stack_matches_op_by_op_on_smollm2_gguf(
    decoder_stack_runs: None, smollm2_gguf_path: Path
) -> None:
    """The shipped GGUF's own Q4_1/Q8_0 blocks (quantization gguf), 4 prompts through 16-row steps: every step
    in the stack."""
    prompts = [[100 + (7 * i + j) % 900 for j in range(5 + 9 * i)] for i in range(4)]
    reference, _, _ = generate(smollm2_gguf_path, False, prompts, GEMV_MAX_ROWS, "gguf")
    stacked, calls, steps = generate(smollm2_gguf_path, True, prompts, GEMV_MAX_ROWS, "gguf")
    assert calls == steps >= 11
    assert_same_outputs(reference, stacked)
