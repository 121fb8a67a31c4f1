"""The real SmolLM2 in bfloat16 with ember's native kernels, with and without speculative decoding, and forced
to each lower ISA level this CPU runs (without AMX, prompt chunks attend on AVX-512 vectors), against the same
engine on PyTorch ops only: greedy continuations agree token for token, with logprobs within bfloat16
rounding, until (at most) a step where the PyTorch path's top two candidates were a near-tie."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ember import LLM, SamplingParams
from ember.kernels.cpu import cpu_isa_level, level_at_least
from ember.kernels.native import load_native_kernels

TEXTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,", "1, 2, 3, 4,",
    "Write a poem about the sea.", "Water boils at", "SELECT name FROM users WHERE", "The quick brown fox",
]
MAX_NEW = 24
# Logits near 20 have a bfloat16 spacing of 0.125: allow two such steps between the two paths.
LOGPROB_TOLERANCE = 0.25


# The CPU's own level ("native"), then the bfloat16 levels below it.
KERNELS = ["native", *(level for level in ("avx512_bf16", "avx512")
                       if level != cpu_isa_level() and level_at_least(cpu_isa_level(), level))]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def greedy(model: Path, kernels: str, speculative_config: dict | None = None) -> list:
    # Three sequences at a time: decode batches of 1-3 rows take the native GEMM (with AMX, every Linear does),
    # on the GGUF's weights dequantized at load (quantization auto would read its blocks for them).
    llm = LLM(str(model), dtype="bfloat16", kernels=kernels, num_threads=1, enable_prefix_caching=False,
              max_num_seqs=3, speculative_config=speculative_config, quantization="none")
    runner = llm.engine.runner
    assert (runner.native is not None) == (kernels != "torch")
    if runner.native is not None:  # prompt chunks attend in place, on AMX tiles or AVX-512 vectors
        assert runner.kernel_paths["attention_prefill"] in ("native_amx", "native_avx512")
    if runner.native is not None and runner.native.gemm_name is not None:
        assert runner.model.lm_head.gemm_weight is not None
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    outputs = [result.outputs[0] for result in llm.generate(TEXTS, params)]
    if speculative_config is not None:  # drafts were verified, on the prompt-chunk attention
        assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
    return outputs


@pytest.fixture(scope="module")
def reference(smollm2_gguf_path: Path) -> list:
    if load_native_kernels("auto", torch.device("cpu"), torch.bfloat16, (576, 1536), 64, 3) is None:
        pytest.skip("native kernels cannot run on this machine")
    return greedy(smollm2_gguf_path, "torch")


@pytest.mark.slow
@pytest.mark.parametrize("speculative_config", [None, NGRAM], ids=["plain", "ngram"])
@pytest.mark.parametrize("kernels", KERNELS)
def test_native_kernels_follow_the_torch_path(smollm2_gguf_path: Path, reference: list, kernels: str,
                                              speculative_config: dict | None) -> None:
    native = greedy(smollm2_gguf_path, kernels, speculative_config)
    identical = 0
    for expected, got in zip(reference, native, strict=True):
        for step, (token, other) in enumerate(zip(expected.token_ids, got.token_ids, strict=True)):
            candidates = sorted(expected.logprobs[step].values(), key=lambda lp: lp.rank)
            if token != other:
                margin = candidates[0].logprob - candidates[1].logprob
                assert margin <= 2 * LOGPROB_TOLERANCE, f"diverged at step {step} despite a margin of {margin}"
                break
            assert abs(expected.logprobs[step][token].logprob - got.logprobs[step][token].logprob) <= (
                LOGPROB_TOLERANCE)
        else:
            identical += 1
    assert identical >= len(TEXTS) // 2
