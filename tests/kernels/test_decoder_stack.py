"""The decoder stack (every layer of a step in one native call: decoder_stack.c in bfloat16 with AMX,
decoder_stack_f32.c in float32 at each ISA level this CPU runs) against the same native kernels called op by op:
the same kernels in the same order, so greedy tokens and logprobs must be identical, bit for bit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ember import LLM, SamplingParams
from ember.errors import EmberError
from ember.kernels.cpu import ISA_LEVELS, cpu_isa_level, level_at_least
from ember.kernels.native import load_native_kernels
from tests.conftest import build_tiny_model_dir

# head_dim 32 and widths that are whole AMX tiles: the smallest shape the native kernels take.
SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2)
# (dtype, --kernels): bfloat16 at the CPU's own level (the stack needs AMX), float32 at every level it runs.
CASES = [("bfloat16", "native")] + [
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
             step_tokens: int) -> tuple[list, int, int]:
    """(outputs, decoder stack calls, model steps)."""
    llm = LLM(str(model_dir), dtype=dtype, kernels=kernels, num_threads=2, enable_prefix_caching=False,
              max_num_seqs=len(prompts), max_num_batched_tokens=step_tokens)
    counts = count_stack_calls(llm)
    if not use_stack:
        llm.engine.runner.model.native = None  # the layers keep their kernels: the op-by-op native path
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
    for expected, got in zip(reference, stacked, strict=True):
        assert got.token_ids == expected.token_ids
        assert [{t: lp.logprob for t, lp in step.items()} for step in got.logprobs] == [
            {t: lp.logprob for t, lp in step.items()} for step in expected.logprobs
        ]
